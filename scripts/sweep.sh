#!/usr/bin/env bash
# A sweep where every member is its own torchrun launch (Hydra's multirun inside torchrun is
# broken upstream). Members are the cartesian product of comma-separated values:
#
#   scripts/sweep.sh [--nproc-per-node N] [--group NAME] -- norm=layernorm,rmsnorm norm.eps=1e-6,1e-3 [fixed=overrides]
#
# Each member gets runs/<group>/<index>, and all members share one W&B group.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nprocs=1; group="sweep-$(date +%Y-%m-%d_%H-%M-%S)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node) nprocs="$2"; shift 2 ;;
    --group) group="$2"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

# Expand "key=a,b" arguments into the list of members (one line of overrides each).
members=("")
for arg in "$@"; do
  key="${arg%%=*}"; values="${arg#*=}"
  if [[ "$arg" == *=* && "$values" == *,* && "$values" != \[* ]]; then
    IFS=',' read -r -a vals <<< "$values"
    next=()
    for m in "${members[@]}"; do for v in "${vals[@]}"; do next+=("$m $key=$v"); done; done
    members=("${next[@]}")
  else
    next=(); for m in "${members[@]}"; do next+=("$m $arg"); done; members=("${next[@]}")
  fi
done

echo "sweep $group: ${#members[@]} members" >&2
status=0
for i in "${!members[@]}"; do
  read -r -a overrides <<< "${members[$i]}"
  echo "[$((i + 1))/${#members[@]}] ${members[$i]}" >&2
  STABILIZE_RUN_DIR="runs/$group/$i" "$here/launch.sh" --nproc-per-node "$nprocs" \
    --run-id "$group-$i" -- "${overrides[@]}" "logger.group=$group" || status=$?
done
exit $status
