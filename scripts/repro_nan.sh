#!/usr/bin/env bash
# The "NaN at step 12000" scenario at CPU scale: every arm, one launch each, then the report.
#
#   scripts/repro_nan.sh [--out DIR] [--experiment nan_repro|nan_repro_natural]
#                        [--arms reference,baseline,fp32_reduction,bf16,large_eps,remedy]
#                        [--seeds N] [--reference-seeds N] [--jobs J] [--cost-rounds N]
#                        [--nproc-per-node N] [-- extra hydra overrides for every arm]
#
# Arms (configs/arm/): reference = the same run without the drift (every verdict is a gap to
# it); baseline = fp16 activations + RMSNorm reduced in fp16; fp32_reduction; bf16 (bf16
# autocast, bf16 reduction); large_eps (eps 1e-3); remedy (the baseline plus rollback). All
# arms share one W&B group (the out dir's name). --seeds N runs every arm with seeds
# 1234..1234+N-1 (dirs <arm>-seed<S>); --reference-seeds N (default 3, at least --seeds) runs
# the reference with more seeds than the others: their spread is the band every gap is
# judged against. --jobs J launches run J at a time (default: the cores / ranks per launch,
# each with OMP_NUM_THREADS = cores / J / ranks). An arm that stops with an error (an abort,
# exit 3) is part of the story: the others still run, and the report says so. Each arm's
# console streams to stderr prefixed with its name and is kept in DIR/<run>.log. With the
# reference among the arms, scripts/arm_cost.py times every arm's step paired with the
# reference's in one process (--cost-rounds N rounds, default 12, ~20 s of one core beside
# the last runs; 0: none) into DIR/cost.json: the report's cost column (without it, none).
# Writes DIR/report.md and DIR/*.png. Python: $PYTHON if set, else `python` on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
experiment=nan_repro; arms=reference,baseline,fp32_reduction,bf16,large_eps,remedy
nprocs=1; out=""; seeds=1; ref_seeds=3; jobs=""; cost_rounds=12
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --experiment) experiment="$2"; shift 2 ;;
    --arms) arms="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --reference-seeds) ref_seeds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --cost-rounds) cost_rounds="$2"; shift 2 ;;
    --nproc-per-node) nprocs="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) echo "repro_nan.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$cost_rounds" =~ ^[0-9]+$ ]]; then
  echo "repro_nan.sh: --cost-rounds=$cost_rounds is not allowed; allowed: 0 or a positive integer" >&2
  exit 2
fi
for pair in "seeds:$seeds" "reference-seeds:$ref_seeds" "jobs:${jobs:-1}" "nproc-per-node:$nprocs"; do
  if ! [[ "${pair#*:}" =~ ^[1-9][0-9]*$ ]]; then
    echo "repro_nan.sh: --${pair%%:*}=${pair#*:} is not allowed; allowed: a positive integer" >&2
    exit 2
  fi
done
cores="$(nproc)"
jobs="${jobs:-$(( cores / nprocs > 0 ? cores / nprocs : 1 ))}"
(( ref_seeds < seeds )) && ref_seeds=$seeds
group="$experiment-$(date +%Y-%m-%d_%H-%M-%S)"
out="${out:-runs/$group}"
group="$(basename "$out")"
IFS=',' read -r -a list <<< "$arms"
runs=(); run_arm=(); run_seed=()
for arm in "${list[@]}"; do
  if [[ ! -f "configs/arm/$arm.yaml" && ! -f "$here/../configs/arm/$arm.yaml" ]]; then
    echo "repro_nan.sh: arm '$arm' is not allowed; allowed: $(ls "$here/../configs/arm" | sed 's/\.yaml$//' | grep -v '^none$' | paste -sd, -)" >&2
    exit 2
  fi
  n=$seeds; [[ "$arm" == reference ]] && n=$ref_seeds
  for (( k = 0; k < n; k++ )); do
    seed=$((1234 + k)); name="$arm"; (( n > 1 )) && name="$arm-seed$seed"
    # a second launch into the same dir would be read as a resume of the first: refuse
    if [[ -n "$(ls -A "$out/$name" 2>/dev/null)" ]]; then
      echo "repro_nan.sh: $out/$name already holds a run; choose another --out or remove it" >&2
      exit 2
    fi
    runs+=("$name"); run_arm+=("$arm"); run_seed+=("$seed")
  done
done
mkdir -p "$out"
threads=$(( cores / jobs / nprocs > 0 ? cores / jobs / nprocs : 1 ))
# the plan first: what runs, how many at once, about how long (measured: docs/scenario.md)
waves=$(( (${#runs[@]} + jobs - 1) / jobs ))
echo "plan: ${#runs[@]} runs (${runs[*]}), $jobs at a time x $nprocs rank(s), $threads thread(s) each;" \
  "$experiment: about $(( waves * 55 )) s on an idle 2-core machine (~55 s a wave of fp16 arms)" \
  | tee "$out/scenario.log" >&2  # the plan and the wall time stay with the run (scenario_doc.py)
start=$SECONDS
# the fused CPU kernel before the first arm, so no arm starts on the fallback while it builds
# in the background (a no-op once built; if it cannot be built, every arm falls back alike)
"${PYTHON:-python}" -m stabilize.cpu_kernels build >&2 || true

launch() {  # one run: the arm's console streams prefixed with its name, rc to $out/<run>.rc
  local name="$1" arm="$2" seed="$3" rc=0
  shift 3
  OMP_NUM_THREADS=$threads STABILIZE_RUN_DIR="$out/$name" "$here/launch.sh" \
    --nproc-per-node "$nprocs" --run-id "$group-$name" \
    -- "experiment=$experiment" "arm=$arm" "seed=$seed" "logger.group=$group" "$@" 2>&1 \
    | tee "$out/$name.log" | while IFS= read -r line; do printf '    %s | %s\n' "$name" "$line"; done >&2 \
    || rc=$?
  echo "$rc" > "$out/$name.rc"
  local what
  case "$rc" in 0) what=done ;; 2) what="config error" ;; 3) what="aborted (stability)" ;; 4) what="preempted (resume=auto goes on)" ;; 5) what="hung (a rank named: ranks/)" ;; *) what=crashed ;; esac
  echo "    $name: $what (exit $rc, $((SECONDS - start)) s so far); log $out/$name.log" >&2
}

running=0
for i in "${!runs[@]}"; do
  if (( running >= jobs )); then wait -n || true; running=$((running - 1)); fi
  echo "[$((i + 1))/${#runs[@]}] ${runs[$i]} -> $out/${runs[$i]} ($((SECONDS - start)) s so far)" >&2
  launch "${runs[$i]}" "${run_arm[$i]}" "${run_seed[$i]}" "$@" &
  running=$((running + 1))
done
# the arms' cost, paired: every arm's step beside the reference's in one process, in the
# queue like a run (the runs' own step times are the machine's load: stabilize/report/cost.py)
if (( cost_rounds > 0 )) && [[ ",$arms," == *,reference,* ]]; then
  if (( running >= jobs )); then wait -n || true; running=$((running - 1)); fi
  echo "[cost] every arm's step paired with the reference's -> $out/cost.json ($((SECONDS - start)) s so far)" >&2
  ( OMP_NUM_THREADS=$threads "${PYTHON:-python}" "$here/arm_cost.py" --out "$out/cost.json" \
      --experiment "$experiment" --arms "$arms" --rounds "$cost_rounds" --threads "$threads" \
      -- "$@" > "$out/cost.log" 2>&1 \
    && echo "    cost: done ($((SECONDS - start)) s so far); log $out/cost.log" >&2 \
    || echo "    cost: failed (see $out/cost.log); the report has no cost column" >&2 ) &
fi
wait || true
# a config error in any run is the user's to fix: say so and stop before the report
for name in "${runs[@]}"; do
  if [[ "$(cat "$out/$name.rc" 2>/dev/null || echo 1)" == 2 ]]; then
    echo "repro_nan.sh: $name: config error (see $out/$name.log); no report" >&2
    exit 2
  fi
done
cost=(); [[ -f "$out/cost.json" ]] && cost=(--cost "$out/cost.json")
"${PYTHON:-python}" -m stabilize.report "${runs[@]/#/$out/}" --out "$out" --title "$experiment: $arms" "${cost[@]}"
echo "scenario done in $((SECONDS - start)) s (${#runs[@]} runs, $jobs at a time); report: $out/report.md" \
  | tee -a "$out/scenario.log" >&2
