"""The full Lightning path against a bare PyTorch loop, step-interleaved in one process.

    python scripts/bench_interleaved.py [--quick] [--configs tiny] [--block 10] [--quads 12]
                                        [--threads 1] [--set monitor=off ...]

bench_step.py times whole runs of each path one after the other; on a shared machine a
drift between two runs moves their ratio by several percent. Here both paths run in the
same process at the same time: a real ``stabilize.train.run`` (every default on: monitors,
rollback snapshots, checkpoints, CSV and W&B offline loggers, progress lines muted) and,
from a callback at the end of its steps, the bare loop of bench_step.py (``bare_steps``:
the same GPTConfig, data, AdamW, LR schedule, clipping and precision, its own model). In
blocks of ``--block`` steps, ordered L B B L per quad (ABBA), so that a drift hits both
alike. A Lightning step's time is the interval between two of its own step ends minus any
bare block run in it; a bare block's time is its own. Per quad the ratio is (bare time per
step) / (Lightning time per step) = Lightning's throughput over the bare loop's; the
verdict is the median over quads (target >= 0.97), its quartiles beside it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import _repo  # noqa: F401  (the repo root on sys.path: benchmarks/, scripts/README.md)
import lightning as L
import torch
from bench_step import AUTOCAST, bare_steps

from benchmarks.lib import (
    CONFIGS,
    add_run_args,
    compose_cfg,
    prepare,
    run_overrides,
    train_with,
)
from benchmarks.stats import print_interleaved

TARGET = 0.97


class Interleave(L.Callback):
    """Times Lightning's steps and runs the bare loop's blocks between them (L B B L)."""

    def __init__(self, bare, block: int, warmup: int, quads: int):
        self.bare, self.block, self.warmup, self.quads = bare, block, warmup, quads
        self.last: float | None = None
        self.steps = 0  # Lightning steps timed (after the warm-up)
        self.l_block, self.blocks_done = 0.0, 0
        self.times: list[tuple[str, float]] = []  # ("L" | "B", seconds per step), in order

    def on_train_start(self, trainer, pl_module):
        for _ in range(self.warmup):  # the bare loop's first slow steps, out of the window
            next(self.bare)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        if trainer.global_step <= self.warmup or self.blocks_done >= 4 * self.quads:
            self.last = now
            return
        self.l_block += now - self.last
        self.steps += 1
        if self.steps % self.block:
            self.last = time.perf_counter()
            return
        self.times.append(("L", self.l_block / self.block))
        self.l_block, self.blocks_done = 0.0, self.blocks_done + 1
        if self.blocks_done % 4 == 1:  # L done: the quad's two bare blocks now
            for _ in range(2):
                t0 = time.perf_counter()
                for _ in range(self.block):
                    loss = next(self.bare)
                loss.item()  # the block's work done (a device sync on CUDA)
                self.times.append(("B", (time.perf_counter() - t0) / self.block))
                self.blocks_done += 1
        self.last = time.perf_counter()


def bench(name: str, args, tmp: Path) -> dict:
    per_quad = 2 * args.block  # Lightning steps per quad
    total = args.warmup + args.quads * per_quad + 1
    overrides = [*run_overrides(CONFIGS[name], args.precision, total, "wandb"), *args.set]
    cfg = compose_cfg(str(tmp / name), overrides)
    # the bare loop needs warmup + 2 x block x quads steps: fewer than the run's total
    clock = Interleave(bare_steps(cfg), args.block, args.warmup, args.quads)
    train_with(cfg, clock)
    t = clock.times
    ratios, lms, bms = [], [], []
    for q in range(len(t) // 4):
        quad = t[4 * q : 4 * q + 4]
        lt = [s for k, s in quad if k == "L"]
        bt = [s for k, s in quad if k == "B"]
        if len(lt) == 2 and len(bt) == 2:
            ratios.append(sum(bt) / sum(lt))
            lms.append(sum(lt) / 2)
            bms.append(sum(bt) / 2)
    return {"name": name, "ratios": ratios, "lms": lms, "bms": bms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, CONFIGS, repeats=1, pairs="(unused here)")
    ap.add_argument("--precision", default="fp32", choices=sorted(AUTOCAST))
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--quads", type=int, default=12, help="L B B L quads timed")
    ap.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides, both paths"
    )
    args = ap.parse_args()
    names = prepare(ap, args, CONFIGS)
    if args.quick:
        args.quads = min(args.quads, 4)
    with tempfile.TemporaryDirectory(prefix="bench_interleaved-") as tmp:
        results = [bench(n, args, Path(tmp)) for n in names]
    print(
        f"\n{args.precision}, blocks of {args.block} steps, L B B L quads, "
        f"{torch.get_num_threads()} torch threads, load average {args.load:.1f} at start on "
        f"{os.cpu_count()} cores; Lightning's throughput / the bare loop's per quad\n"
    )
    print_interleaved(results, "Lightning", "lms", TARGET)


if __name__ == "__main__":
    main()
