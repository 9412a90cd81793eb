"""A plain loop under ``stabilize.Guard`` against the same loop bare, step-interleaved in one
process.

    python scripts/bench_guard.py [--quick] [--configs tiny] [--block 10] [--quads 12]
                                  [--threads 1] [--set model.d_model=512 model.n_head=8 ...]

Two copies of bench_step.py's bare loop (``bare_steps``: the same GPTConfig, data, AdamW, LR
schedule, clipping and precision, each its own model) run side by side, one of them under a
``Guard`` with the run's monitor and rollback settings (every default on: every monitor, the
snapshot ring; the Guard unscales, judges and clips where the bare loop unscales and clips).
In blocks of ``--block`` steps, ordered G B B G per quad (ABBA), so that a drift of the
shared machine hits both alike. Per quad the ratio is (bare time per step) / (guarded time
per step): the guarded loop's throughput over the bare one's; the verdict is the median
over quads (target >= 0.97), its quartiles beside it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import torch
from bench_step import AUTOCAST, bare_steps

from benchmarks.lib import CONFIGS, add_run_args, compose_cfg, prepare, run_overrides
from benchmarks.stats import print_interleaved

TARGET = 0.97


def _block(steps, n: int) -> float:
    """Seconds per step over ``n`` steps of the generator ``steps``."""
    t0 = time.perf_counter()
    for _ in range(n):
        loss = next(steps)
    loss.item()  # the block's work done (a device sync on CUDA)
    return (time.perf_counter() - t0) / n


def bench(name: str, args, tmp: Path) -> dict:
    total = args.warmup + 2 * args.block * args.quads + 1
    overrides = [*run_overrides(CONFIGS[name], args.precision, total, "none"), *args.set]
    cfg = compose_cfg(str(tmp / name), overrides)
    bare, guarded = bare_steps(cfg), bare_steps(cfg, guard_dir=tmp / f"{name}-guard")
    for _ in range(args.warmup):  # the first slow steps of both, out of the window
        next(bare)
        next(guarded)
    ratios, gms, bms = [], [], []
    for _ in range(args.quads):
        g1 = _block(guarded, args.block)
        b1, b2 = _block(bare, args.block), _block(bare, args.block)
        g2 = _block(guarded, args.block)
        ratios.append((b1 + b2) / (g1 + g2))
        gms.append((g1 + g2) / 2)
        bms.append((b1 + b2) / 2)
    return {"name": name, "ratios": ratios, "gms": gms, "bms": bms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=1, pairs="(unused here)")
    ap.add_argument("--precision", default="fp32", choices=sorted(AUTOCAST))
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--quads", type=int, default=12, help="G B B G quads timed")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Hydra overrides, both loops")  # fmt: skip
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.quads = min(args.quads, 4)
    with tempfile.TemporaryDirectory(prefix="bench_guard-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    print(
        f"\n{args.precision}, blocks of {args.block} steps, G B B G quads, "
        f"{torch.get_num_threads()} torch threads, load average {args.load:.1f} at start on "
        f"{os.cpu_count()} cores; the guarded loop's throughput / the bare loop's per quad\n"
    )
    print_interleaved(results, "Guard", "gms", TARGET)


if __name__ == "__main__":
    main()
