#!/usr/bin/env bash
# A sweep where every member is its own torchrun launch (Hydra's multirun inside torchrun is
# broken upstream). Members are the cartesian product of the swept overrides, expanded by
# Hydra's own override parser (a,b,c  choice(a,b)  range(1,4)  sort(...)):
#
#   scripts/sweep.sh [--nproc-per-node N] [--group NAME] [--dry-run] -- norm=layernorm,rmsnorm 'norm.eps=choice(1e-6,1e-3)' [fixed=overrides]
#
# Each member gets runs/<group>/<index>, and all members share one W&B group; stabilize-report
# names them by the swept key=value pairs. --dry-run prints the members and launches nothing.
# Exit code: the worst member's (a crash > 3 stability abort > 2 config error > 4 preempted > 0 done).
# Python: $PYTHON if set, else the one beside the installed stabilize-train, else the repo's .venv.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nprocs=1; group="sweep-$(date +%Y-%m-%d_%H-%M-%S)"; dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node) nprocs="$2"; shift 2 ;;
    --group) group="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

# The package's Python, not whatever `python` is first on PATH (the system one has no torch).
if [[ -z "${PYTHON:-}" ]]; then
  if entry="$(command -v stabilize-train)" && [[ -x "$(dirname "$entry")/python" ]]; then
    PYTHON="$(dirname "$entry")/python"
  elif [[ -x "$here/../.venv/bin/python" ]]; then
    PYTHON="$here/../.venv/bin/python"
  else
    echo "sweep.sh: no stabilize-train on PATH and no .venv beside the repo: set PYTHON=/path/to/python" >&2
    exit 2
  fi
fi
export PYTHON  # launch.sh runs torchrun with it

# One member per line, each override shell-quoted; refused (exit 2, one line) if unexpandable.
lines="$("$PYTHON" -m stabilize.sweep "$@")" || exit 2
mapfile -t members <<< "$lines"

echo "sweep $group: ${#members[@]} members" >&2
if [[ $dry -eq 1 ]]; then printf '%s\n' "${members[@]}"; exit 0; fi
# The sweep's exit code is its worst member's: a crash (any other code) > 5 (hung) > 3 (a
# stability abort) > 2 (a config error) > 4 (preempted: requeue it) > 0 (stabilize/exits.py).
severity() { case "$1" in 0) echo 0 ;; 4) echo 1 ;; 2) echo 2 ;; 3) echo 3 ;; 5) echo 4 ;; *) echo 5 ;; esac; }
meaning() { case "$1" in 0) echo done ;; 2) echo "config error" ;; 3) echo aborted ;; 4) echo preempted ;; 5) echo hung ;; *) echo crashed ;; esac; }
status=0
for i in "${!members[@]}"; do
  eval "overrides=(${members[$i]})"  # safe: every word was quoted by shlex.quote
  echo "[$((i + 1))/${#members[@]}] ${members[$i]}" >&2
  rc=0
  STABILIZE_RUN_DIR="runs/$group/$i" "$here/launch.sh" --nproc-per-node "$nprocs" \
    --run-id "$group-$i" -- "${overrides[@]}" "logger.group=$group" || rc=$?
  echo "    member $i: $(meaning "$rc") (exit $rc)" >&2
  if [[ $(severity "$rc") -gt $(severity "$status") ]]; then status=$rc; fi
done
exit $status
