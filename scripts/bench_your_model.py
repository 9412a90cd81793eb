"""The monitors' cost on a Hugging Face GPT-2 against our GPT of the same size (issue 36,
"Done when" 4: within 1 point).

Each measurement is the in-run ABBA toggle (benchmarks/monitor_toggle.py): one
training run switches every monitor and the snapshots off and on every 10 steps, and the
overhead is the median over quads of (on blocks) / (off blocks) - 1. The two models are
run alternately in one process, in ABBA order over rounds (ours, theirs, theirs, ours,
...), so that the shared machine's drifts hit both: ``model=tiny`` (our GPT: 2 layers,
d_model 128, 4 heads, block 128, vocab 256) and ``model=hf model.hf.arch=gpt2`` (Hugging
Face's GPT2LMHeadModel built from the same keys: same widths, GELU-tanh, biases, a tied
head, learned positions; its norms swapped for ours, which reduce in fp32 as its own do).
On our GPT the probe reads a block's output through the next norm (one pass); on theirs
every block output and every norm input is read by a hook (a pass each): what this
measures is what that costs.

It prints each round's overhead per model (wall clock; process CPU time beside it), the
medians, and per clock the per-round differences with a distribution-free interval for
their median (the sign test's, ~90% or more: benchmarks/stats.py ``median_interval``),
and says "within 1 point" only where that interval lies inside +-1 point, "not within"
where it lies outside, else "not resolved" with the interval.

Usage: python scripts/bench_your_model.py [--rounds 4] [--steps 240] [--warmup 20]
       [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch

from benchmarks.lib import compose_cfg, run_overrides
from benchmarks.monitor_toggle import toggle_bench
from benchmarks.stats import load_average, median_interval

MODELS = {
    "our GPT": ["model=tiny"],
    "HF GPT-2": ["model=hf", "model.hf.arch=gpt2"],
}
# no held-out score after the timed steps: a benchmark does not need it
ON = ["monitor=default", "rollback=default", "rollback.durable_every=0",
      "trainer.final_eval_batches=0"]  # fmt: skip


def verdict(lo: float, hi: float) -> str:
    """The 1-point target against the interval of the median difference."""
    if lo >= -1.0 and hi <= 1.0:
        return "within 1 point (the median difference's interval lies inside +-1)"
    if lo > 1.0 or hi < -1.0:
        return "not within 1 point (the median difference's interval lies outside +-1)"
    return (f"not resolved at 1 point: the median difference's interval is {lo:+.1f} to "
            f"{hi:+.1f} (more rounds, or a quieter machine)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="toggle runs per model (ABBA order)")
    ap.add_argument("--steps", type=int, default=240, help="toggled steps per run (40 a quad)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 80 steps (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 80
    for key in ("rounds", "steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key}={getattr(args, key)} is not allowed; allowed: a positive integer")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"monitors' cost, our GPT vs Hugging Face GPT-2 of the same size: {args.rounds} "
          f"rounds x {args.steps} toggled steps, {torch.get_num_threads()} threads, "
          f"load average {load_average():.2f} on {os.cpu_count()} cores", flush=True)  # fmt: skip
    order = [["our GPT", "HF GPT-2"], ["HF GPT-2", "our GPT"]]
    got: dict[str, list[float]] = {m: [] for m in MODELS}
    step_ms: dict[str, list[float]] = {m: [] for m in MODELS}
    cpu: dict[str, list[float]] = {m: [] for m in MODELS}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in order[r % 2]:
                total = args.warmup + args.steps
                common = run_overrides(MODELS[name], "fp32", total, "none")
                run_dir = Path(tmp) / f"{name.replace(' ', '_')}-{r}"
                cfg = compose_cfg(str(run_dir), [*common, *ON])
                out = toggle_bench(cfg, args.steps, args.warmup, 0.0, 0)
                got[name].append(100 * statistics.median(out["t"]))
                cpu[name].append(100 * statistics.median(out["cpu"]))
                step_ms[name].append(out["t_step_ms"])
                print(f"  round {r + 1}: {name:9s} {got[name][-1]:+.1f}% over {out['quads']} "
                      f"quads (step {out['t_step_ms']:.1f} ms with the monitors off; "
                      f"{time.perf_counter() - t0:.0f} s so far)", flush=True)  # fmt: skip
    print("\n| model | overhead per round (wall clock) | median | process CPU time, median "
          "| step (monitors off) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name in MODELS:
        rounds = ", ".join(f"{v:+.1f}%" for v in got[name])
        print(f"| {name} | {rounds} | {statistics.median(got[name]):+.1f}% | "
              f"{statistics.median(cpu[name]):+.1f}% | "
              f"{statistics.median(step_ms[name]):.1f} ms |")  # fmt: skip
    for clock, series in (("wall clock", got), ("process CPU time", cpu)):
        diffs = [h - g for h, g in zip(series["HF GPT-2"], series["our GPT"], strict=True)]
        lo, hi, cover = median_interval(diffs)
        print(f"\nHF GPT-2 minus our GPT ({clock}), per round: "
              f"{', '.join(f'{d:+.1f}' for d in diffs)} points; median "
              f"{statistics.median(diffs):+.1f}, {100 * cover:.0f}% interval {lo:+.1f} to "
              f"{hi:+.1f}")  # fmt: skip
        print(f"verdict ({clock}): {verdict(lo, hi)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
