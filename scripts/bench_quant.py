"""What a quantized run costs on a CPU, four loops interleaved in one process.

    python scripts/bench_quant.py [--quant fp8_delayed] [--configs tiny] [--block 5]
                                  [--rounds 6] [--threads 1] [--set model.d_model=512 ...]

bench_step.py's bare loop four ways, each its own model, the same config and data:

- ``bf16``: bf16 autocast, no quantized GEMM (the reference a quantized run is weighed
  against);
- ``emulated``: the same with ``quant=<recipe>`` (every Linear but the head quantized and
  dequantized around a high-precision matmul: emulation, on a CPU);
- ``guarded``: ``emulated`` under ``stabilize.Guard`` with every default monitor, the
  ``quant`` monitor among them (each quantized operand's counts on every step);
- ``no_counts``: the same Guard with ``monitor.quant.enabled=false`` (the counts on log
  steps only).

In rounds of blocks of ``--block`` steps, ordered A B C D D C B A (so that a drift of the
shared machine hits all alike); per round the ratios of throughput: emulated / bf16 (the
emulation's own cost), guarded / emulated (the whole harness on a quantized run),
guarded / no_counts (the counts on every step, on top of the rest). Medians over rounds,
quartiles beside them; the target: the counts cost <= 3% of a step (guarded / no_counts
>= 0.97).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch
from bench_guard import _block
from bench_step import bare_steps

from benchmarks.lib import CONFIGS, add_run_args, compose_cfg, prepare, run_overrides

TARGET = 0.97
RATIOS = (("emulated", "bf16"), ("guarded", "emulated"), ("guarded", "no_counts"))


def bench(name: str, args, tmp: Path) -> dict:
    total = args.warmup + 2 * args.block * args.rounds + 1
    base = [*run_overrides(CONFIGS[name], "bf16-mixed", total, "none"), *args.set]
    q = [*base, f"quant={args.quant}"]
    loops = {
        "bf16": bare_steps(compose_cfg(str(tmp / "bf16"), base)),
        "emulated": bare_steps(compose_cfg(str(tmp / "emulated"), q)),
        "guarded": bare_steps(compose_cfg(str(tmp / "g"), q), guard_dir=tmp / "guarded"),
        "no_counts": bare_steps(
            compose_cfg(str(tmp / "n"), [*q, "monitor.quant.enabled=false"]),
            guard_dir=tmp / "no_counts",
        ),  # fmt: skip
    }
    for steps in loops.values():  # the first slow steps of each, out of the window
        for _ in range(args.warmup):
            next(steps)
    times: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(args.rounds):
        order = list(loops)
        for k in order + order[::-1]:  # A B C D D C B A
            times[k].append(_block(loops[k], args.block))
    per_round = {
        k: [sum(v[2 * i : 2 * i + 2]) for i in range(args.rounds)] for k, v in times.items()
    }
    ratios = {f"{a} / {b}": [tb / ta for ta, tb in zip(per_round[a], per_round[b], strict=True)]
              for a, b in RATIOS}  # fmt: skip
    ms = {k: 1000 * statistics.median(v) / 2 for k, v in per_round.items()}
    return {"name": name, "ms": ms, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=1, pairs="(unused here)")
    ap.add_argument("--quant", default="fp8_delayed", help="the recipe (configs/quant/)")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--rounds", type=int, default=6, help="A B C D D C B A rounds timed")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides, every loop")  # fmt: skip
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.rounds = min(args.rounds, 2)
    with tempfile.TemporaryDirectory(prefix="bench_quant-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    print(
        f"\nquant={args.quant}, bf16 autocast, blocks of {args.block} steps, A B C D D C B A "
        f"rounds, {torch.get_num_threads()} torch threads, load average {args.load:.1f} at "
        f"start on {os.cpu_count()} cores; throughput ratios per round\n"
    )
    print("| config | ms/step: bf16, emulated, guarded, no_counts | ratio | median | quartiles |")
    print("|---|---|---|---|---|")
    for r in results:
        steps = ", ".join(f"{r['ms'][k]:.1f}" for k in ("bf16", "emulated", "guarded", "no_counts"))
        for label, vals in r["ratios"].items():
            q = statistics.quantiles(vals, n=4) if len(vals) > 1 else vals * 3
            print(f"| {r['name']} | {steps} | {label} | {statistics.median(vals):.3f} "
                  f"| {q[0]:.3f} to {q[2]:.3f} |")  # fmt: skip
    print()
    for r in results:
        ratio = round(statistics.median(r["ratios"]["guarded / no_counts"]), 3)  # as printed
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        print(f"target {r['name']}: the counts on every step, guarded / no_counts = {ratio:.3f} "
              f"(>= {TARGET}) {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
