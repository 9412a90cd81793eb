#!/usr/bin/env bash
# The "NaN at step 12000" scenario at CPU scale: every arm, one launch each, then the report.
#
#   scripts/repro_nan.sh [--out DIR] [--experiment nan_repro|nan_repro_natural]
#                        [--arms baseline,fp32_reduction,bf16,large_eps,remedy]
#                        [--nproc-per-node N] [-- extra hydra overrides for every arm]
#
# Arms (configs/arm/): baseline = fp16 activations + RMSNorm reduced in fp16; fp32_reduction;
# bf16 (bf16 autocast, bf16 reduction); large_eps (eps 1e-3); remedy (rollback with the ladder
# skip_data -> lower_lr -> fp32_reduction). All arms share one W&B group (the out dir's name).
# An arm that stops with an error (e.g. an abort, exit 3) is part of the story: the others
# still run, and the report says so. Each arm's console streams to stderr as it runs (lines
# prefixed with the arm) and is kept in DIR/<arm>.log. Writes DIR/report.md and DIR/*.png.
# Python: $PYTHON if set (e.g. PYTHON=.venv/bin/python), else `python` on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
experiment=nan_repro; arms=baseline,fp32_reduction,bf16,large_eps,remedy; nprocs=1; out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --experiment) experiment="$2"; shift 2 ;;
    --arms) arms="$2"; shift 2 ;;
    --nproc-per-node) nprocs="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) echo "repro_nan.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
group="$experiment-$(date +%Y-%m-%d_%H-%M-%S)"
out="${out:-runs/$group}"
group="$(basename "$out")"
IFS=',' read -r -a list <<< "$arms"
for arm in "${list[@]}"; do
  if [[ ! -f "configs/arm/$arm.yaml" && ! -f "$here/../configs/arm/$arm.yaml" ]]; then
    echo "repro_nan.sh: arm '$arm' is not allowed; allowed: $(ls "$here/../configs/arm" | sed 's/\.yaml$//' | grep -v '^none$' | paste -sd, -)" >&2
    exit 2
  fi
  # a second launch into the same dir would be read as a resume of the first: refuse
  if [[ -n "$(ls -A "$out/$arm" 2>/dev/null)" ]]; then
    echo "repro_nan.sh: $out/$arm already holds a run; choose another --out or remove it" >&2
    exit 2
  fi
done
mkdir -p "$out"
start=$SECONDS
# the fused CPU kernel before the first arm, so no arm starts on the fallback while it builds
# in the background (a no-op once built; if it cannot be built, every arm falls back alike)
"${PYTHON:-python}" -m stabilize.cpu_kernels build >&2 || true
for i in "${!list[@]}"; do
  arm="${list[$i]}"
  echo "[$((i + 1))/${#list[@]}] arm=$arm -> $out/$arm ($((SECONDS - start)) s so far)" >&2
  rc=0
  # the arm's console (step lines, stability events, its summary) streams as it runs, each
  # line prefixed with the arm, and goes whole into its log; rc: the launch's (pipefail)
  STABILIZE_RUN_DIR="$out/$arm" "$here/launch.sh" --nproc-per-node "$nprocs" --run-id "$group-$arm" \
    -- "experiment=$experiment" "arm=$arm" "logger.group=$group" "$@" 2>&1 \
    | tee "$out/$arm.log" | while IFS= read -r line; do printf '    %s | %s\n' "$arm" "$line"; done >&2 \
    || rc=$?
  case "$rc" in 0) what=done ;; 2) what="config error" ;; 3) what="aborted (stability)" ;; *) what=crashed ;; esac
  echo "    arm=$arm: $what (exit $rc); log $out/$arm.log" >&2
done
"${PYTHON:-python}" -m stabilize.report "${list[@]/#/$out/}" --out "$out" --title "$experiment: $arms"
echo "scenario done in $((SECONDS - start)) s; report: $out/report.md" >&2
