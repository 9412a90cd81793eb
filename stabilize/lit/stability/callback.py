"""The stability callback: feeds the monitors once per step, acts on their verdict.

Thin: the step gather (``gather.py``), NaN localization (``localize.py``), the rollback
controller (``controller.py``: snapshot, restore, remedy, abort) and the event sink
(``sink.py``: events.jsonl, console, W&B alerts, metrics and counts) do the work; this
file says when. Every rank runs the same monitors on the same numbers and takes the same
decision: warn, snapshot, roll back with a remedy, or abort with a diagnosis.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from stabilize.faults import FaultConfig, FaultInjector
from stabilize.lit.fsdp import is_fsdp
from stabilize.lit.probe import StabilityProbe
from stabilize.lit.stability.controller import RollbackController
from stabilize.lit.stability.gather import HEAD, StepGather
from stabilize.lit.stability.localize import localize_nonfinite
from stabilize.lit.stability.sink import EventSink
from stabilize.monitors import ROLLBACK, Event, MonitorConfig, MonitorSuite, StepStats
from stabilize.rollback import RollbackConfig
from stabilize.rollback.sharded import Sharder


class StabilityCallback(L.Callback):
    def __init__(
        self,
        monitor: MonitorConfig,
        rollback: RollbackConfig,
        fault: FaultConfig,
        run_dir: str,
        accumulate: int = 1,
    ):
        self.mcfg, self.rcfg, self.fcfg = monitor, rollback, fault
        # without monitors nothing can call for a rollback: no snapshots to pay for either
        self.rollback_on = rollback.enabled and monitor.enabled
        self.run_dir = Path(run_dir)
        self.accumulate = accumulate
        self.suite = MonitorSuite(monitor)
        # a monitor that reads a log-step-only series gets it on every step
        self._detailed_always = bool(self.suite.needs & StabilityProbe.DETAILED_ONLY)
        self.sink = EventSink(run_dir, self.rollback_on)
        self.controller = RollbackController(rollback, run_dir, self.suite, self.sink)
        self.gather = StepGather(accumulate)
        self.probe: StabilityProbe | None = None
        self.injector: FaultInjector | None = None
        self.last: StepStats | None = None
        self._pending: tuple | None = None
        self._batch = None
        self._localized = False

    # the parts, by the names scripts/bench_monitors.py and the tests reach for
    @property
    def counts(self) -> dict[str, int]:
        return self.sink.counts

    @property
    def ring(self):
        return self.controller.ring

    @property
    def writer(self):
        return self.controller.writer

    @property
    def policy(self):
        return self.controller.policy

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        model = pl_module.model
        # The fault's hook first: hooks run in registration order, and the probe must
        # measure what the next layer really receives.
        self.injector = FaultInjector(self.fcfg, rank=trainer.global_rank)
        self.injector.attach(model)
        pl_module.injector = self.controller.injector = self.injector
        if getattr(self, "_fault_state", None):  # resumed: loaded before this runs
            self.injector.load_state_dict(self._fault_state)
        if self.mcfg.enabled:
            self.probe = StabilityProbe(model, lead=HEAD)
        # DDP replicas hold the same state: each rank snapshots 1/world of it (sharded.py)
        world = trainer.world_size if isinstance(trainer.strategy, DDPStrategy) else 1
        fsdp = is_fsdp(trainer.strategy)  # each rank's state is its shard already
        self.controller.sharder = Sharder(trainer.global_rank, world, fsdp=fsdp)
        if world > 1 and self.rollback_on:
            rank_zero_info(f"[stability] snapshots sharded: each of {world} ranks keeps 1/{world}")

    def on_train_start(self, trainer, pl_module):
        if self.rollback_on:
            self._snapshot(trainer, pl_module)  # a floor to return to, before any step

    def on_train_end(self, trainer, pl_module):
        self.sink.close(trainer)
        self.writer.wait()  # the last durable snapshot is on disk before fit returns

    def on_exception(self, trainer, pl_module, exception):
        # an abort or a crash: the durable snapshot in flight is still written (it predates
        # the fault), then the original exception goes on
        self.sink.close(trainer)
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001  (the training error is the one to report)
            rank_zero_info(f"[stability] the durable snapshot in flight failed too: {e!r}")

    def teardown(self, trainer, pl_module, stage):
        self.writer.close()

    # ---- per step -----------------------------------------------------------------------
    # The verdict is reached in on_before_optimizer_step: gradients are unscaled and the
    # loss known, but nothing is applied yet. A bad step is then made a no-op (gradients
    # dropped, as torchtitan stops before the optimizer), so the weights the localization
    # replays and the snapshot ring never see it; the restore itself waits for
    # on_train_batch_end, after Lightning's step / scaler update / scheduler bookkeeping.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # the first fresh micro-batch of an optimizer step (not data_step % accumulate: a
        # skip_data remedy may move the position by any number of micro-batches)
        if pl_module.window_start and self.probe is not None:
            # this step is logged iff Lightning's step after it is a multiple of the interval
            logged = (trainer.global_step + 1) % trainer.log_every_n_steps == 0
            detailed = logged or self._detailed_always
            self.probe.reset(detailed=detailed, device=pl_module.device, logged=logged)
        self._batch = batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.stale_batch or not (self.mcfg.enabled or self.rollback_on):
            return
        stats = self._gather(trainer, pl_module, optimizer)
        events = self.suite.update(stats)
        self.last = stats
        bad = [e for e in events if e.kind == ROLLBACK]
        nonfinite = next((e for e in bad if e.monitor == "nonfinite"), None)
        # Where did it start? Every time when it is rolled back; without rollback, for the
        # first one only (a run left to go on would replay every step after it).
        if nonfinite is not None and (self.rollback_on or not self._localized):
            nonfinite.extra["localization"] = localize_nonfinite(trainer, pl_module, self._batch)
            self._localized = True
        if bad and self.rollback_on:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is applied
            pl_module.skip_step = True
        self._pending = (stats, events, bad[0] if bad and self.rollback_on else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.stale_batch or self._pending is None:
            return  # a stale batch, or mid-accumulation: no optimizer step was judged
        stats, events, fault = self._pending
        self._pending = None
        # the step's scalars every step, the per-layer series on log steps (sink.py)
        self._log_stats(trainer, stats, trainer.global_step % trainer.log_every_n_steps == 0)
        for e in events:
            self.sink.emit(trainer, e)
        if fault is not None:
            self._rollback(trainer, pl_module, fault)
        elif self.rollback_on and pl_module.model_step % self.rcfg.snapshot_every == 0:
            self._snapshot(trainer, pl_module)

    # ---- the parts (methods, so that a benchmark can time each one) ------------------------
    def _gather(self, trainer, pl_module, optimizer) -> StepStats:
        """One vector, one collective, one host transfer."""
        return self.gather(trainer, pl_module, optimizer, self.probe)

    def _log_stats(self, trainer, s: StepStats, layers: bool = True) -> None:
        dims = self.probe.dims if self.probe is not None else None
        self.sink.log_stats(trainer, s, self.suite.forecast, dims, layers)

    def _snapshot(self, trainer, pl_module) -> None:
        self.controller.snapshot(trainer, pl_module)

    def restore(self, trainer, pl_module, st: dict) -> None:
        """Load a snapshot's state into the live model, optimizer, scheduler, scaler and
        monitors (no remedy, no data seek)."""
        self.controller.restore(trainer, pl_module, st)

    def _rollback(self, trainer, pl_module, event: Event) -> None:
        self.controller.rollback(trainer, pl_module, event, self.last)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: a resumed run keeps its monitors' windows, its
        rollback history (the ladder) and its fault's course."""
        return {
            "monitors": self.suite.state_dict(),
            "policy": self.policy.state_dict(),
            "counts": dict(self.counts),
            "fault": self.injector.state_dict() if self.injector else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.suite.load_state_dict(state["monitors"])
        self.policy.load_state_dict(state["policy"])
        self.counts.update(state["counts"])
        self._fault_state = state.get("fault")
        if self.injector is not None and self._fault_state:  # Lightning restores after setup
            self.injector.load_state_dict(self._fault_state)
