"""Step time with every stability monitor and rollback snapshots on vs all off, one process.

Each config (``tiny``; ``small`` = tiny with 4 layers; optional ``125m`` = GPT-3 Small with a
128-token context and batch 4, seconds per step on a CPU) is composed with Hydra as the CLI
does it and trained through ``stabilize.train.run`` in two arms, same seed, data and model:

- off: ``monitor=off rollback=off`` (no probe hooks, no norm statistics, no snapshots; the
  callback still stacks and reads the loss / grad-norm head once per step);
- on: the defaults, ``monitor=default rollback=default`` (probe hooks, norm statistics, one
  gather + host read per step, every monitor incl. the Theil-Sen forecast, per-layer metrics
  every 10 steps, a memory snapshot every 10 steps, a durable one every 100).

Both arms: fp32 (``--precision``), validation off (``limit_val_batches=0``), periodic
checkpoints and logs at the defaults, logger ``--logger`` (default W&B offline + CSV, as a
real run; ``none``: CSV only). A callback stamps ``perf_counter`` and ``process_time`` after
every optimizer step; ms/step = (t[warmup + steps] - t[warmup]) / steps, so at the defaults
(10 + 100) the window holds exactly 10 memory snapshots, 1 durable snapshot, 10 log steps and
1 checkpoint: their amortised cost. Arms are interleaved (off, on, on, off, ...); per arm the
median over repeats is shown, with the per-pair overhead on/off - 1 of those window means.

The verdict (target <= 2%: all default monitors together) is steadier than a ratio of two
window means, which one stall of another job on our core moves by several percent: the
window is cut into blocks of 10 steps
(each holds one log step and one memory snapshot, so a block is a fair unit of the on-arm's
work), block i of the on-run is paired with block i of the off-run of the same pair (same
data, same periodic work), and the pair's overhead is the median over blocks of the block
ratios, plus the durable snapshot's amortised cost (its measured write time / durable_every
steps: the one block that holds it is an outlier the median drops). The verdict is the
median of that over pairs, wall clock; the same from process CPU time is shown beside it
(other jobs' time on our core is not in it, their cache and memory traffic still is).

Where the on-arm's time goes, per step in the window (wrappers around the callback's own
methods, in process CPU time: a preemption inside one is not charged to it): the gather
(stack + host read; net of the step's grad-norm computation, which clipping would do
anyway), the monitors' Python, ``_log_stats`` and the snapshots; "rest" =
CPU overhead - those = probe hooks + norm statistics in the forward + Lightning/loggers
handling the extra per-layer metrics.

After the last timed step of each on-run (the run is stopping; the window is closed), it
times directly, median of ``--reps``:
- snapshot: ``StabilityCallback._snapshot`` (memory ring only; durable_every off for it);
- durable: ``stabilize.rollback.save_durable`` of that snapshot (torch.save + fsync + rename),
  as if synchronous; the run writes it on a background thread (``DurableWriter``), and the
  hand-over, what training waits for, is shown beside it. The verdicts add the whole write
  amortised, as if it blocked: an upper bound;
- restore: the load_state_dict part of ``_rollback`` (model, optimizer, scheduler, scaler,
  monitors);
- rollback: the whole ``_rollback`` with a synthetic ROLLBACK event and ladder ``[retry]``
  (policy, restore, LR re-imposition, data seek, event log, W&B alert), restoring the
  snapshot just taken, so nothing else changes. Not included: the one prefetched (stale)
  batch that a real rollback then drops.
Each is shown as a multiple of the off-arm's median step time (target: rollback < 1 step).

On a busy 2-core machine two OpenMP threads stall whenever another job holds a core: the
header prints the load average; use --threads 1 there.

A third measurement, in one run (benchmarks/monitor_toggle.py, ``--toggle-steps``): the
monitors switched off and on every 10 steps in ABBA order, so the machine's drifts hit both.
Neither it nor the pairs is a verdict on the harness's cost: both compare it with itself
switched off inside Lightning, not with a bare loop; scripts/bench_cost.py gives the cost a
user pays, part by part.
``--replicas-steps N`` measures only the replica fingerprint the same way (monitors on in
every block; the fingerprint every 10 steps in "on" blocks, as ``monitor.replicas.every``
does in a multi-process run), and the fingerprint's own time, timed directly.

Usage: python scripts/bench_monitors.py [--quick] [--steps 100] [--warmup 10] [--repeats 4]
       [--configs tiny,small[,125m]] [--precision fp32] [--logger wandb|none] [--threads N]
       [--toggle-steps 0]

Files: this one runs the pairs; in benchmarks/, monitor_clock.py times the parts and the
snapshot / restore, monitor_toggle.py the in-run toggle, monitor_report.py prints the tables
and verdicts; the harness (lib.py) and the robust statistics (stats.py) are shared with the
other benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)

from benchmarks.lib import CONFIGS as BASE_CONFIGS
from benchmarks.lib import add_run_args, compose_cfg, prepare, run_overrides, train_with
from benchmarks.monitor_clock import PARTS, BenchClock
from benchmarks.monitor_report import report
from benchmarks.monitor_toggle import FingerprintToggle, toggle_bench
from benchmarks.stats import block_overhead, window_blocks
from stabilize.run.config import RunConfig

CONFIGS = {
    **BASE_CONFIGS,
    # GPT-3 Small's width and depth, short context and batch: ~1-3 s/step on 2 CPU cores
    "125m": ["model=gpt-125m", "model.block_size=128", "data.batch_size=4"],
}
ARMS = {
    "off": ["monitor=off", "rollback=off"],
    "on": ["monitor=default", "rollback=default"],
}


def one_run(cfg: RunConfig, args, scratch: Path) -> tuple[BenchClock, float]:
    clock = BenchClock((args.warmup, args.warmup + args.steps), args.reps, scratch)
    out = train_with(cfg, clock)
    return clock, out["metrics"].get("train/loss", float("nan"))


def bench(name: str, args, tmp: Path) -> dict:
    warm, total = args.warmup, args.warmup + args.steps
    common = run_overrides(CONFIGS[name], args.precision, total, args.logger)
    ms: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    robust: list[float] = []  # per pair: block-median overhead (+ durable amortised)
    cpu_robust: list[float] = []
    parts: dict[str, list[float]] = defaultdict(list)
    timings: dict[str, list[float]] = defaultdict(list)
    snapshot_mb = 0.0
    for r in range(args.repeats):
        pair, clocks = {}, {}
        for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
            run_dir = tmp / f"{name}-{r}-{arm}"
            cfg = compose_cfg(str(run_dir), [*common, *ARMS[arm]])
            clock, loss = one_run(cfg, args, run_dir)
            clocks[arm] = clock
            pair[arm] = 1000 * (clock.t[total] - clock.t[warm]) / args.steps
            ms[arm].append(pair[arm])
            cpu[arm].append(1000 * (clock.cpu[total] - clock.cpu[warm]) / args.steps)
            if arm == "on":
                net = dict(clock.parts, gather=clock.parts["gather"] - clock.parts["grad_norm"])
                for p in PARTS:
                    parts[p].append(1000 * net.get(p, 0.0) / args.steps)
                for k, v in clock.timings.items():
                    timings[k].append(1000 * v)
                snapshot_mb = clock.snapshot_mb
            print(
                f"  {name} #{r} {arm:3s} {pair[arm]:8.2f} ms/step (CPU {cpu[arm][-1]:8.2f})  "
                f"loss {loss:.4f}",
                flush=True,
            )
        ratios.append(pair["on"] / pair["off"] - 1)
        cpu_ratios.append(cpu["on"][-1] / cpu["off"][-1] - 1)
        on, off = clocks["on"], clocks["off"]
        # the durable write, once per durable_every steps, is in one block only: amortised
        durable = 0.0
        if on.durable_every and "durable" in on.timings:
            durable = on.timings["durable"] / on.durable_every
        for key, out in (("t", robust), ("cpu", cpu_robust)):
            b_on = window_blocks(getattr(on, key), warm, total)
            b_off = window_blocks(getattr(off, key), warm, total)
            out.append(block_overhead(b_on, b_off) + durable / statistics.median(b_off))
    toggled = {}
    if args.toggle_steps:
        durable_every = on.durable_every
        cfg = compose_cfg(
            str(tmp / f"{name}-toggle"),
            [
                *common,
                *ARMS["on"],
                f"trainer.max_steps={warm + args.toggle_steps}",
                "rollback.durable_every=0",
            ],
        )
        med = statistics.median(timings["durable"]) if timings.get("durable") else 0.0
        toggled = toggle_bench(cfg, args.toggle_steps, warm, med, durable_every)
        print(
            f"  {name} toggled in one run: {100 * statistics.median(toggled['t']):+.1f}% over "
            f"{toggled['quads']} quads",
            flush=True,
        )
    return {
        "name": name,
        "toggled": toggled,
        "params": sum(p.numel() for p in clock._trainer.lightning_module.model.parameters()),
        "ms": ms,
        "cpu": cpu,
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "robust": robust,
        "cpu_robust": cpu_robust,
        "parts": {p: statistics.median(v) for p, v in parts.items()},
        "timings": {k: statistics.median(v) for k, v in timings.items()},
        "snapshot_mb": snapshot_mb,
    }


def replicas_bench(name: str, args, tmp: Path) -> None:
    """The replica fingerprint's overhead inside one run (ABBA blocks), and its own time."""
    import time

    from stabilize.stability.gather import fingerprint, fingerprint_chunks

    warm = args.warmup
    common = run_overrides(CONFIGS[name], args.precision, warm + args.replicas_steps, args.logger)
    cfg = compose_cfg(str(tmp / f"{name}-fp"), [*common, *ARMS["on"], "rollback.durable_every=0"])
    clock = FingerprintToggle(warm)
    tg = toggle_bench(cfg, args.replicas_steps, warm, 0.0, 0, clock=clock)
    params = list(clock.model.parameters())
    times = []
    for _ in range(max(args.reps, 20)):
        t0 = time.perf_counter()
        fingerprint_chunks(fingerprint(params)).tolist()
        times.append(time.perf_counter() - t0)
    fp_ms, step_ms = 1000 * statistics.median(times), tg["t_step_ms"]
    q = sorted(tg["t"])
    print(
        f"  {name}: replica fingerprint every 10 steps, in-run ABBA toggle "
        f"{100 * statistics.median(q):+.2f}% (quartiles {100 * q[len(q) // 4]:+.2f}% .. "
        f"{100 * q[(3 * len(q)) // 4]:+.2f}%, {tg['quads']} quads); timed directly "
        f"{fp_ms:.3f} ms per fingerprint = {100 * fp_ms / step_ms:.2f}% of a {step_ms:.1f} ms "
        f"step, {10 * fp_ms / step_ms:.3f}% amortised over 10 steps",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=4, pairs="(off, on)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each snapshot timing")
    ap.add_argument("--precision", default="fp32", help="a configs/precision name")
    ap.add_argument("--logger", default="wandb", choices=["wandb", "none"], help="both arms")
    ap.add_argument(
        "--toggle-steps",
        type=int,
        default=0,
        help="steps of the in-run ABBA toggle measurement (20 quads at 800; not a verdict: "
        "scripts/bench_cost.py measures the cost a user pays); 0 (the default): skip it",
    )
    ap.add_argument(
        "--replicas-steps", type=int, default=0, help="only the replica fingerprint's toggle"
    )
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.replicas_steps:
        with tempfile.TemporaryDirectory(prefix="bench_replicas-") as tmp:
            for n in names:
                replicas_bench(n, args, Path(tmp))
        return
    if args.quick:
        args.toggle_steps = min(args.toggle_steps, 160)
    with tempfile.TemporaryDirectory(prefix="bench_monitors-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    report(results, args)


if __name__ == "__main__":
    main()
