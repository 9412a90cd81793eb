#!/usr/bin/env bash
# Launch stabilize-train under torchrun, single- or multi-node; every rank shares one run dir.
#
#   scripts/launch.sh [--nproc-per-node N] [--nnodes M] [--node-rank R]
#                     [--rdzv-endpoint HOST:PORT] [--run-id ID] [--max-restarts K]
#                     [--] [hydra overrides...]
#
# One node, 8 GPUs:   scripts/launch.sh --nproc-per-node 8 model=gpt-1.3b precision=fp16-mixed
# Two nodes (run on each, same --run-id and endpoint):
#   scripts/launch.sh --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29500 --run-id exp1 ...
# On CPU the ranks talk over gloo: scripts/launch.sh --nproc-per-node 2 trainer.accelerator=cpu
# --max-restarts K: torchrun restarts the whole group up to K times when a rank dies; the
# restarted group resumes from the newest intact checkpoint by itself (no resume=auto).
# Exit code: 0 done, 2 config error (nothing written), 3 stability abort, 4 preempted (a
# checkpoint at the signal: requeue with resume=auto), 5 hung (a rank named by the watchdog),
# 128+N killed by signal N, else crashed.
set -euo pipefail

nprocs=1; nnodes=1; node_rank=""; endpoint=""; run_id="${STABILIZE_RUN_ID:-}"; restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node) nprocs="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --rdzv-endpoint) endpoint="$2"; shift 2 ;;
    --run-id) run_id="$2"; shift 2 ;;
    --max-restarts) restarts="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

if [[ "$nnodes" -gt 1 && ( -z "$endpoint" || -z "$run_id" ) ]]; then
  echo "launch.sh: --nnodes $nnodes needs --rdzv-endpoint HOST:PORT and --run-id ID (the same on every node)" >&2
  exit 2
fi
# The id all ranks (and nodes) use for the run dir: runs/<name>/<id> unless STABILIZE_RUN_DIR.
export STABILIZE_RUN_ID="${run_id:-$(date +%Y-%m-%d_%H-%M-%S)-$$}"

args=(--nproc-per-node "$nprocs" --nnodes "$nnodes" --max-restarts "$restarts")
if [[ "$nnodes" -gt 1 ]]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$STABILIZE_RUN_ID")
  [[ -n "$node_rank" ]] && args+=(--node-rank "$node_rank")
else
  args+=(--standalone)
fi
# OMP threads per rank: share the cores instead of oversubscribing them.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( ( $(nproc) + nprocs - 1 ) / nprocs ))}"
# torchrun through stabilize.launch: the exit code is the ranks' own when it means something
# (2 config error, 3 stability abort) instead of torchrun's 1 and a ChildFailedError traceback.
exec "${PYTHON:-python}" -m stabilize.launch "${args[@]}" -m stabilize.train "$@"
