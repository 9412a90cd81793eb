"""The monitors' cost measured inside one run: on and off in alternating blocks of steps.

Two separate runs (bench_monitors.py's pairs) see the shared machine at different moments;
a neighbour's job landing on one of them moves the estimate by more than the 3% it looks
for. Here a single training run switches every monitor and the snapshots off and on every
BLOCK steps in ABBA order (on, off, off, on, ...), so a drift of the machine's speed hits
both arms alike and a linear one cancels within each quad of blocks.

"Off" is what ``monitor=off rollback=off`` does: the probe's hooks are removed (norms stop
collecting statistics) and the stability callback's per-step work is skipped, so no gather,
no monitors, no per-layer logging, no snapshot. "On" puts them back (a new probe; the
monitors keep their windows). The first step of each block carries the switch and is left
out; a block holds one memory snapshot (every 10 steps) when on. The run writes no durable
snapshot (one every 100 steps would land in one block only); its cost, timed directly by
bench_monitors.py, is added back amortised. The estimate is the median over quads of
(on blocks) / (off blocks) - 1, in wall-clock and in process CPU time.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time

import lightning as L
import wandb
from benchlib import mute_progress

import stabilize.train
from stabilize.lit.probe import StabilityProbe
from stabilize.lit.stability import HEAD, StabilityCallback

BLOCK = 10
ABBA = (True, False, False, True)


class Toggle(L.Callback):
    def __init__(self, warmup: int):
        self.warmup = warmup
        self.t: dict[int, float] = {}
        self.cpu: dict[int, float] = {}
        self.on: dict[int, bool] = {}  # block index -> monitors on

    def on_train_start(self, trainer, pl_module):
        mute_progress(trainer)
        self.sc = next(cb for cb in trainer.callbacks if isinstance(cb, StabilityCallback))
        self.model = pl_module.model
        self.judge = self.sc.on_before_optimizer_step
        self.t[0], self.cpu[0] = time.perf_counter(), time.process_time()

    def _switch(self, on: bool) -> None:
        sc = self.sc
        if on and sc.probe is None:
            sc.probe = StabilityProbe(self.model, lead=HEAD)
        elif not on and sc.probe is not None:
            sc.probe.remove()
            sc.probe = None
        # an instance attribute: Lightning looks hooks up on the callback object
        sc.on_before_optimizer_step = self.judge if on else (lambda *a, **k: None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        g = trainer.global_step
        if g >= self.warmup and (g - self.warmup) % BLOCK == 0:
            b = (g - self.warmup) // BLOCK
            self.on[b] = ABBA[b % 4]
            self._switch(self.on[b])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        g = trainer.global_step
        self.t[g], self.cpu[g] = time.perf_counter(), time.process_time()


def _block_means(stamps: dict[int, float], warmup: int, n_blocks: int) -> list[float]:
    """Mean step time of each block, its first step (the switch) left out."""
    out = []
    for b in range(n_blocks):
        first = warmup + b * BLOCK + 1  # global step after the block's first step
        last = warmup + (b + 1) * BLOCK
        out.append((stamps[last] - stamps[first]) / (last - first))
    return out


def quad_overheads(means: list[float]) -> list[float]:
    """Per ABBA quad: mean of its on blocks / mean of its off blocks - 1."""
    out = []
    for q in range(len(means) // 4):
        m = means[4 * q : 4 * q + 4]
        out.append((m[0] + m[3]) / (m[1] + m[2]) - 1)
    return out


def position_overhead(stamps: dict[int, float], on: dict[int, bool], warmup: int, n: int):
    """A cross-check of the quad median, robust to stalls in another way: for each position
    in a block (the switch step left out), the median step time over the on blocks and over
    the off blocks; the overhead is sum(on medians) / sum(off medians) - 1. Work done once
    per block (the log step, the snapshot) sits at one position and counts in full; a stall
    of the machine lands in one block at one position, and a median drops it."""
    per: dict[bool, list[list[float]]] = {arm: [[] for _ in range(BLOCK)] for arm in (True, False)}
    for b in range(n):
        for pos in range(2, BLOCK + 1):  # global steps after steps 2..BLOCK of the block
            g = warmup + b * BLOCK + pos
            per[on[b]][pos - 1].append(stamps[g] - stamps[g - 1])
    on_sum = sum(statistics.median(x) for x in per[True] if x)
    off_sum = sum(statistics.median(x) for x in per[False] if x)
    return on_sum / off_sum - 1


def toggle_bench(cfg, steps: int, warmup: int, durable_ms: float, durable_every: int) -> dict:
    """One run of ``cfg`` (monitors and rollback on, durable snapshots off) with ``steps``
    toggled steps after ``warmup``; the durable write (``durable_ms`` every
    ``durable_every`` steps) is added back amortised."""
    n_blocks = (steps // (4 * BLOCK)) * 4
    clock = Toggle(warmup)
    with contextlib.redirect_stdout(io.StringIO()):
        stabilize.train.run(cfg, callbacks=[clock])
    wandb.teardown()
    out = {}
    for key in ("t", "cpu"):
        means = _block_means(getattr(clock, key), warmup, n_blocks)
        off_step = statistics.median(m for b, m in enumerate(means) if not clock.on[b])
        extra = (durable_ms / 1000 / durable_every / off_step) if durable_every else 0.0
        quads = quad_overheads(means)
        out[key] = [q + extra for q in quads]
        out[f"{key}_step_ms"] = 1000 * off_step
        out[f"{key}_positions"] = (
            position_overhead(getattr(clock, key), clock.on, warmup, n_blocks) + extra
        )
    out["quads"] = len(out["t"])
    return out
