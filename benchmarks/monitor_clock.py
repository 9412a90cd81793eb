"""Where the monitors' time goes: the on-arm's clock of bench_monitors.py.

On top of the step stamps (benchmarks.lib.StepClock) it wraps the stability callback's own
methods, by the names ``StabilityCallback`` keeps for this (``_gather``, ``_log_stats``,
``_snapshot``, ``restore``, ``_rollback``; the suite's ``update``), and adds up each one's
process CPU time inside the timed window: a preemption inside one is not charged to it.
After the window's last step it times a snapshot, its durable write, a restore and a whole
rollback directly (bench_monitors.py's docstring says what each includes).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.lib import StepClock
from benchmarks.stats import median_time
from stabilize.lit.stability import StabilityCallback
from stabilize.monitors import ROLLBACK, Event
from stabilize.rollback import save_durable
from stabilize.stability.engine import StabilityEngine

# the parts timed in the window -> their column in the report; each is wrapped in
# BenchClock.on_train_start (a new part: one entry here, one _wrap there)
PARTS = {
    "gather": "gather",
    "monitors": "monitors",
    "log_stats": "log_stats",
    "snapshot": "snapshots",
}


def nbytes(obj) -> int:
    """Bytes held by the tensors in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


class BenchClock(StepClock):
    """perf_counter after every optimizer step; on the on-arm, time spent in the stability
    callback's parts inside the window, then the snapshot / restore timings at its end."""

    def __init__(self, edges: tuple[int, int], reps: int, scratch: Path):
        super().__init__(edges)
        self.reps, self.scratch = reps, scratch
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
    def _stability(trainer) -> StabilityEngine:
        return next(cb for cb in trainer.callbacks if isinstance(cb, StabilityCallback)).engine

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        super().on_train_start(trainer, pl_module)
        sc = self._stability(trainer)
        self._wrap(sc, "gather_step", "gather")
        self._wrap(sc.suite, "update", "monitors")
        self._wrap(sc, "log_stats", "log_stats")
        self._wrap(sc, "snapshot", "snapshot")
        # the step's grad norm is computed by its first caller (now the gather; clipping
        # reuses it): the off arm pays it too, in clipping, so it is taken out of "gather"
        self._wrap(pl_module, "grad_total_norm", "grad_norm")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        self._counting = self.edges[0] <= step < self.edges[1]
        sc = self._stability(trainer)
        if step == self.edges[1] and sc.rcfg.enabled:
            self._time_rollback(trainer, pl_module, sc)

    def _time_rollback(self, trainer, pl_module, sc: StabilityEngine) -> None:
        sync = torch.cuda.synchronize if pl_module.device.type == "cuda" else lambda: None
        durable_every, sc.rcfg.durable_every = sc.rcfg.durable_every, 0
        self.durable_every = durable_every
        self.timings["snapshot"] = median_time(lambda: (sc.snapshot(), sync()), self.reps)
        sc.rcfg.durable_every = durable_every
        snap = sc.ring.ring[-1]  # at the current model step
        self.snapshot_mb = nbytes(snap.state) / 2**20
        self.timings["durable"] = median_time(
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
            sc.restore(snap.state)
            sync()

        self.timings["restore"] = median_time(restore, self.reps)
        # the whole rollback, restoring the snapshot just taken (event step - margin = it);
        # ladder [retry]: no remedy changes anything; the policy's history is cleared each
        # time so that the one-rung ladder never aborts.
        sc.rcfg.ladder = ["retry"]  # the policy holds the same config object
        step = pl_module.train_state.model_step
        event = Event(ROLLBACK, "bench", step + sc.rcfg.margin, "bench_monitors: timing")

        def rollback():
            sc.policy.history.clear()
            sc.rollback(event)
            sync()

        self.timings["rollback"] = median_time(rollback, self.reps)
        assert pl_module.train_state.model_step == step, "the timed rollback moved the model step"
