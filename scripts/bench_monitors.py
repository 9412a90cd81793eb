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

The verdict (target <= 3%) is steadier than a ratio of two window means, which one stall of
another job on our core moves by several percent: the window is cut into blocks of 10 steps
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

The verdict comes from a third measurement, in one run (scripts/monitor_toggle.py): the
monitors switched off and on every 10 steps in ABBA order, so the machine's drifts hit both.

Usage: python scripts/bench_monitors.py [--quick] [--steps 100] [--warmup 10] [--repeats 4]
       [--configs tiny,small[,125m]] [--precision fp32] [--logger wandb|none] [--threads N]
       [--toggle-steps 800]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import lightning as L  # noqa: E402
import torch  # noqa: E402
import wandb  # noqa: E402
from benchlib import CONFIGS as BASE_CONFIGS  # noqa: E402  (sets the offline environment)
from benchlib import compose_cfg, mute_progress, prepare, run_overrides  # noqa: E402
from monitor_toggle import toggle_bench  # noqa: E402

import stabilize.train  # noqa: E402
from stabilize.lit.config import RunConfig  # noqa: E402
from stabilize.lit.stability import StabilityCallback  # noqa: E402
from stabilize.monitors import ROLLBACK, Event  # noqa: E402
from stabilize.rollback import save_durable  # noqa: E402

CONFIGS = {
    **BASE_CONFIGS,
    # GPT-3 Small's width and depth, short context and batch: ~1-3 s/step on 2 CPU cores
    "125m": ["model=gpt-125m", "model.block_size=128", "data.batch_size=4"],
}
ARMS = {
    "off": ["monitor=off", "rollback=off"],
    "on": ["monitor=default", "rollback=default"],
}
PARTS = ("gather", "monitors", "log_stats", "snapshot")
OVERHEAD_MAX = 0.03  # on/off - 1
RESTORE_MAX = 1.0  # steps
NOISY = 0.04  # max - min of the per-pair overhead estimates: the verdict is flagged
BLOCK = 10  # steps per block of the robust estimate: one log step, one memory snapshot


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class BenchClock(L.Callback):
    """perf_counter after every optimizer step; on the on-arm, time spent in the stability
    callback's parts inside the window, then the snapshot / restore timings at its end."""

    def __init__(self, edges: tuple[int, int], reps: int, scratch: Path):
        self.edges, self.reps, self.scratch = edges, reps, scratch
        self.t: dict[int, float] = {}
        self.cpu: dict[int, float] = {}
        self.parts: dict[str, float] = defaultdict(float)
        self.timings: dict[str, float] = {}
        self.snapshot_mb = 0.0
        self.durable_every = 0  # the on-arm's rollback.durable_every
        self._trainer = None
        self._counting = False  # from the stamp of step warmup to that of the last step

    def _wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:  # the package moved on: that part reads 0
            return

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._counting:
                    self.parts[part] += time.process_time() - t0

        setattr(obj, attr, timed)  # an instance attribute: this run's callback only

    @staticmethod
    def _stability(trainer) -> StabilityCallback:
        return next(cb for cb in trainer.callbacks if isinstance(cb, StabilityCallback))

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        mute_progress(trainer)
        sc = self._stability(trainer)
        self._wrap(sc, "_gather", "gather")
        self._wrap(sc.suite, "update", "monitors")
        self._wrap(sc, "_log_stats", "log_stats")
        self._wrap(sc, "_snapshot", "snapshot")
        # the step's grad norm is computed by its first caller (now the gather; clipping
        # reuses it): the off arm pays it too, in clipping, so it is taken out of "gather"
        self._wrap(pl_module, "grad_total_norm", "grad_norm")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.edges and pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.t[step] = time.perf_counter()
        self.cpu[step] = time.process_time()
        self._counting = self.edges[0] <= step < self.edges[1]
        sc = self._stability(trainer)
        if step == self.edges[1] and sc.rcfg.enabled:
            self._time_rollback(trainer, pl_module, sc)

    def _time_rollback(self, trainer, pl_module, sc: StabilityCallback) -> None:
        sync = torch.cuda.synchronize if pl_module.device.type == "cuda" else lambda: None
        durable_every, sc.rcfg.durable_every = sc.rcfg.durable_every, 0
        self.durable_every = durable_every
        self.timings["snapshot"] = _median_time(
            lambda: (sc._snapshot(trainer, pl_module), sync()), self.reps
        )
        sc.rcfg.durable_every = durable_every
        snap = sc.ring.ring[-1]  # at the current model step
        self.snapshot_mb = _nbytes(snap.state) / 2**20
        self.timings["durable"] = _median_time(
            lambda: save_durable(snap, self.scratch / "snapshots"), self.reps
        )
        # what training waits for when the write goes to the background thread (the run's
        # default): the hand-over, each one timed after the previous write has finished
        handover = []
        for _ in range(self.reps):
            sc.writer.wait()
            t0 = time.perf_counter()
            sc.writer.submit(snap, self.scratch / "background")
            handover.append(time.perf_counter() - t0)
        sc.writer.wait()
        self.timings["handover"] = statistics.median(handover)

        def restore():
            sc.restore(trainer, pl_module, snap.state)
            sync()

        self.timings["restore"] = _median_time(restore, self.reps)
        # the whole rollback, restoring the snapshot just taken (event step - margin = it);
        # ladder [retry]: no remedy changes anything; the policy's history is cleared each
        # time so that the one-rung ladder never aborts.
        sc.rcfg.ladder = ["retry"]  # the policy holds the same config object
        step = pl_module.model_step
        event = Event(ROLLBACK, "bench", step + sc.rcfg.margin, "bench_monitors: timing")

        def rollback():
            sc.policy.history.clear()
            sc._rollback(trainer, pl_module, event)
            sync()

        self.timings["rollback"] = _median_time(rollback, self.reps)
        assert pl_module.model_step == step, "the timed rollback moved the model step"


def one_run(cfg: RunConfig, args, scratch: Path) -> tuple[BenchClock, float]:
    edges = (args.warmup, args.warmup + args.steps)
    clock = BenchClock(edges, args.reps, scratch)
    with contextlib.redirect_stdout(io.StringIO()):  # W&B chatter
        out = stabilize.train.run(cfg, callbacks=[clock])
    wandb.teardown()  # stop W&B's service process: it must not run during the next run
    return clock, out["metrics"].get("train/loss", float("nan"))


def _blocks(stamps: dict[int, float], warm: int, total: int) -> list[float]:
    """Time per step of each block of BLOCK steps in the window (one block if shorter)."""
    size = min(BLOCK, total - warm)
    edges = range(warm, total + 1, size)
    return [(stamps[b] - stamps[a]) / size for a, b in zip(edges, edges[1:], strict=False)]


def _block_overhead(on: list[float], off: list[float]) -> float:
    """Median over blocks of block-i on / block-i off - 1."""
    return statistics.median(a / b - 1 for a, b in zip(on, off, strict=True))


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
            b_on = _blocks(getattr(on, key), warm, total)
            b_off = _blocks(getattr(off, key), warm, total)
            out.append(_block_overhead(b_on, b_off) + durable / statistics.median(b_off))
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


def _quartiles(xs: list[float]) -> str:
    q1, q2, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return f"{q2:+.1f}% ({q1:+.1f} to {q3:+.1f}; {min(xs):+.1f} to {max(xs):+.1f})"


def report(results: list[dict], args) -> None:
    def span(xs, fmt):
        m, lo, hi = (fmt.format(f(xs)) for f in (statistics.median, min, max))
        return f"{m} ({lo} to {hi})"

    print(
        f"\n{args.precision}, logger {args.logger}, {args.steps} timed steps after "
        f"{args.warmup}, {args.repeats} pairs (off/on interleaved), {torch.get_num_threads()} "
        f"torch threads, load average {args.load:.1f} at start on {os.cpu_count()} cores; "
        f"median (min to max) over pairs\n"
    )
    print("| config | params | off ms/step | on ms/step | off CPU ms/step | on CPU ms/step |")
    print("|---|---|---|---|---|---|")
    for res in results:
        ms, cpu = res["ms"], res["cpu"]
        print(
            f"| {res['name']} | {res['params'] / 1e6:.2f}M | {span(ms['off'], '{:.2f}')} "
            f"| {span(ms['on'], '{:.2f}')} | {span(cpu['off'], '{:.2f}')} "
            f"| {span(cpu['on'], '{:.2f}')} |"
        )
    print(
        f"\nOverhead on/off - 1 per pair, median (min to max) over pairs. Block median: "
        f"median over {BLOCK}-step blocks of paired block ratios + the durable snapshot "
        f"amortised (the verdict); window: ratio of the window means.\n"
    )
    print("| config | block median (verdict) | window | CPU block median | CPU window |")
    print("|---|---|---|---|---|")
    for res in results:
        cells = " | ".join(
            span([100 * x for x in res[k]], "{:+.1f}%")
            for k in ("robust", "ratios", "cpu_robust", "cpu_ratios")
        )
        print(f"| {res['name']} | {cells} |")
    print(
        "\nWhere the on-arm's extra time goes, ms per step in the window (median over runs, "
        "% of the off step); rest = CPU overhead - parts:\n"
    )
    print(
        "| config | CPU overhead | gather | monitors | log_stats | snapshots "
        "| rest (hooks, norm stats, loggers) |"
    )
    print("|---|---|---|---|---|---|---|")
    for res in results:
        p, base = res["parts"], statistics.median(res["cpu"]["off"])
        over = statistics.median(res["cpu"]["on"]) - base
        rest = over - sum(p.values())
        cells = " | ".join(f"{v:.3f} ({100 * v / base:.1f}%)" for v in [*p.values(), rest])
        print(f"| {res['name']} | {over:+.3f} ({100 * over / base:+.1f}%) | {cells} |")
    print(
        f"\nSnapshot / restore, median of {args.reps}, ms and (x off-arm step time); "
        "rollback = the whole _rollback:\n"
    )
    print(
        "| config | state MB | step ms | snapshot | durable write | its hand-over (background) "
        "| restore | rollback |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        step = statistics.median(res["ms"]["off"])
        t = res["timings"]
        keys = ("snapshot", "durable", "handover", "restore", "rollback")
        cells = " | ".join(f"{t[k]:.2f} ({t[k] / step:.2f}x)" for k in keys)
        print(f"| {res['name']} | {res['snapshot_mb']:.1f} | {step:.2f} | {cells} |")
    toggled = [r for r in results if r["toggled"]]
    if toggled:
        print(
            f"\nIn one run, monitors switched on and off every {BLOCK} steps in ABBA order "
            f"(scripts/monitor_toggle.py): on/off - 1 per quad of blocks, median (quartiles, "
            f"min to max) over quads, durable write amortised:\n"
        )
        print(
            "| config | quads | off ms/step | wall (verdict) | CPU "
            "| per-position medians, wall (cross-check) |"
        )
        print("|---|---|---|---|---|---|")
        for res in toggled:
            tg = res["toggled"]
            cells = " | ".join(_quartiles([100 * x for x in tg[k]]) for k in ("t", "cpu"))
            print(
                f"| {res['name']} | {tg['quads']} | {tg['t_step_ms']:.2f} | {cells} "
                f"| {100 * tg['t_positions']:+.1f}% |"
            )
    print()
    for res in results:
        if res["toggled"]:
            est, how = res["toggled"]["t"], "in-run ABBA toggle"
        else:
            est, how = res["robust"], "block median of run pairs"
        ratio = statistics.median(est)
        verdict = "PASS" if ratio <= OVERHEAD_MAX else "FAIL"
        q1, _, q3 = statistics.quantiles(est, n=4) if len(est) > 1 else (ratio, ratio, ratio)
        if q3 - q1 > NOISY:  # the estimates disagree: their median is not to be trusted
            verdict += (
                f" (NOISY: the estimates' quartiles span {100 * (q3 - q1):.1f} points; "
                "rerun with --threads 1 and/or more steps)"
            )
        print(
            f"target {res['name']}: overhead on/off - 1 ({how}) = {100 * ratio:+.1f}% "
            f"(<= {100 * OVERHEAD_MAX:.0f}%) {verdict}"
        )
        steps = res["timings"]["rollback"] / statistics.median(res["ms"]["off"])
        verdict = "PASS" if steps < RESTORE_MAX else "FAIL"
        print(
            f"target {res['name']}: restore from memory (whole _rollback) = {steps:.2f} steps "
            f"(< {RESTORE_MAX:g}) {verdict}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 2 pairs (< 90 s)")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=4, help="(off, on) pairs")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each snapshot timing")
    ap.add_argument("--configs", default="tiny,small", help=f"of {sorted(CONFIGS)}")
    ap.add_argument("--precision", default="fp32", help="a configs/precision name")
    ap.add_argument("--logger", default="wandb", choices=["wandb", "none"], help="both arms")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument(
        "--toggle-steps",
        type=int,
        default=800,
        help="steps of the in-run ABBA toggle measurement (the verdict; 20 quads: at 10 "
        "the quartiles spanned ~3-4 points on this shared machine); 0: skip it",
    )
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.toggle_steps = min(args.toggle_steps, 160)
    with tempfile.TemporaryDirectory(prefix="bench_monitors-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    report(results, args)


if __name__ == "__main__":
    main()
