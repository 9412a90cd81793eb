"""The stability callback: feeds the monitors once per step, acts on their verdict.

Thin: the parts in ``stabilize/stability/`` (no Lightning there), the step gather
(``gather.py``), the re-run classification (``classify.py``) with
NaN localization in the forward and the backward (``localize.py``), the rollback
controller (``controller.py``: snapshot, restore, remedy, abort) and the event sink
(``sink.py``: events.jsonl, console, W&B alerts, metrics and counts) do the work; this
file says when. Every rank runs the same monitors on the same numbers and takes the same
decision: warn, snapshot, roll back with a remedy, or abort with a diagnosis.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from stabilize.data import parse_skip_items
from stabilize.faults import FaultConfig, FaultInjector
from stabilize.lit.fsdp import is_fsdp
from stabilize.monitors import ROLLBACK, Event, MonitorConfig, MonitorSuite, StepStats
from stabilize.rollback import RollbackConfig
from stabilize.rollback.sharded import Sharder
from stabilize.stability import grad_scan
from stabilize.stability.bundle import write_bundle
from stabilize.stability.classify import LOCALIZED, Classifier
from stabilize.stability.console import GAP
from stabilize.stability.controller import (
    RollbackController,
    load_skipped,
    load_skipped_items,
)
from stabilize.stability.gather import HEAD, StepGather
from stabilize.stability.localize import first_named, locate
from stabilize.stability.probe import StabilityProbe
from stabilize.stability.sink import EventSink


def _sharded(trainer) -> bool:
    """FSDP2 (``trainer.strategy=fsdp``), or a module that clips sharded gradients itself:
    parameters and gradients are shards (no replay, no replica fingerprint)."""
    return is_fsdp(trainer.strategy) or hasattr(trainer.strategy.model, "clip_grad_norm_")


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
        self.classifier = Classifier(self.gather, self.suite)
        rep = monitor.replicas
        self.replicas_every = rep.every if monitor.enabled and rep.enabled else 0
        self.probe: StabilityProbe | None = None
        self._scanned = -(GAP + 1)  # the step whose gradients were last scanned (_scan_grads)
        self._bundled: set[str] = set()  # monitors bundled already (rollback off: once each)
        self._bundled_note = False  # the FSDP "no bundle" line, said once
        self.injector: FaultInjector | None = None
        self.last: StepStats | None = None
        self._pending: tuple | None = None
        self._batches: list = []  # the step's fresh micro-batches, and their data positions
        self._positions: list[int] = []
        self._detailed = False
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
        # a data-linked fault's batches stay skipped across launches (in place: the
        # sampler shares the set)
        pl_module.train_state.skipped |= load_skipped(self.run_dir)
        # and the sequences found by stabilize-replay --data, or named in data.skip_items
        items = pl_module.train_state.skipped_items
        items.update(parse_skip_items(pl_module.cfg.data.skip_items))
        items.update(load_skipped_items(self.run_dir))
        if self.mcfg.enabled:
            self.probe = StabilityProbe(model, lead=HEAD)
        # DDP replicas hold the same state: each rank snapshots 1/world of it (sharded.py)
        world = trainer.world_size if isinstance(trainer.strategy, DDPStrategy) else 1
        fsdp = is_fsdp(trainer.strategy)  # each rank's state is its shard already
        self.controller.sharder = Sharder(trainer.global_rank, world, fsdp=fsdp)
        if world > 1 and self.rollback_on:
            rank_zero_info(f"[stability] snapshots sharded: each of {world} ranks keeps 1/{world}")

    def on_train_start(self, trainer, pl_module):
        data = pl_module.train_dataloader().dataset  # the trainer's (cached) loader's
        self.injector.bind_data(getattr(data, "dataset", data))  # the blocks, untagged
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
            self._detailed = logged or self._detailed_always
            self.probe.reset(detailed=self._detailed, device=pl_module.device, logged=logged)
        self._batch = batch
        if pl_module.window_start:
            self._batches, self._positions = [], []
        if not pl_module.stale_batch:
            self._batches.append(batch)
            self._positions.append(pl_module.train_state.data_step)

    def on_after_backward(self, trainer, pl_module):
        # Lightning calls this before the module's own hook, where a fault may write a
        # parameter: the durable copy of the last snapshot's state has landed by then
        self.controller.sharder.fence()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.stale_batch or not (self.mcfg.enabled or self.rollback_on):
            return
        stats = self._gather(trainer, pl_module, optimizer)
        events = self.suite.update(stats)
        self.last = stats
        nonfinite = stats.grad_norm is not None and not math.isfinite(stats.grad_norm)
        bad = [e for e in events if e.kind == ROLLBACK]
        if bad:
            over = [e.layer for e in bad if e.monitor == "overflow"]
            if over:  # every norm that overflowed at this step (the fp32_sites remedy)
                bad[0].extra["overflowed"] = over
            self._classify(trainer, pl_module, bad)
        if nonfinite and not _sharded(trainer):  # FSDP: each rank holds a shard's gradients
            self._scan_grads(trainer, pl_module, stats, events)
        self._bundle(trainer, pl_module, stats, events, bad)
        if bad and self.rollback_on:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is applied
            pl_module.train_state.skip_step = True
        self._pending = (stats, events, bad[0] if bad and self.rollback_on else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.stale_batch or self._pending is None:
            return  # a stale batch, or mid-accumulation: no optimizer step was judged
        stats, events, fault = self._pending
        self._pending = None
        # the step's scalars every step, the per-layer series on log steps (sink.py) and on a
        # step whose gradients were scanned (their per-block norms, inf / nan kept)
        log_step = trainer.global_step % trainer.log_every_n_steps == 0
        self._log_stats(trainer, stats, log_step or self._scanned == stats.step)
        for e in events:
            self.sink.emit(trainer, e)
        if fault is not None:
            self._rollback(trainer, pl_module, fault)
        elif self.rollback_on and pl_module.train_state.model_step % self.rcfg.snapshot_every == 0:
            self._snapshot(trainer, pl_module)

    # ---- the parts (methods, so that a benchmark can time each one) ------------------------
    def _gather(self, trainer, pl_module, optimizer) -> StepStats:
        """One vector, one collective, one host transfer (with every rank's parameter
        fingerprint every ``monitor.replicas.every`` steps)."""
        n = 0 if _sharded(trainer) else self.replicas_every  # shards differ by design
        due = bool(n) and trainer.world_size > 1 and (pl_module.train_state.model_step + 1) % n == 0
        return self.gather(trainer, pl_module, optimizer, self.probe, replicas=due)

    def _bundle(self, trainer, pl_module, stats, events: list[Event], bad: list[Event]) -> None:
        """A repro bundle of the step (bundle.py), before anything is restored. Every rank
        takes the same decision (same events), as the gather of the batches needs."""
        mode = self.rcfg.bundle
        worth = bad if mode == "fault" else [e for e in events if e.kind != "info"]
        if not self.rollback_on:  # nothing is undone: a monitor's first verdict is the evidence
            worth = [e for e in worth if e.monitor not in self._bundled]
            self._bundled |= {e.monitor for e in worth}
        if mode == "off" or not worth:
            return
        fsdp = is_fsdp(trainer.strategy)
        if _sharded(trainer) and not fsdp:  # a module that shards itself: no one copy
            if not self._bundled_note and trainer.is_global_zero:
                print("[bundle] no repro bundle: the parameters are sharded", flush=True)
            self._bundled_note = True
            return
        write_bundle(trainer, pl_module, stats, worth, self._batches, self._positions, self.rcfg,
                     sharded=fsdp)  # fmt: skip

    def _scan_grads(self, trainer, pl_module, stats: StepStats, events: list[Event]) -> None:
        """A non-finite gradient norm (a NaN or inf, an fp16 scaler skip): where it was made
        (grad_scan.py). The localization of a ROLLBACK verdict's replay where there is one
        (``_classify`` ran first); else, on the first non-finite step of an episode, the step
        re-run with hooks; the step's own gradients scanned once in any case. The module
        goes into the verdict's message (the console), its extra (events.jsonl,
        diagnosis.json) and the step's logs."""
        info = grad_scan.scan(pl_module.model, loss_finite=math.isfinite(stats.loss))
        stats.layer_grad_norm = {**stats.layer_grad_norm, **info.pop("block_grad_norm")}
        located = [e.extra["localization"] for e in events if "localization" in e.extra]
        if located:
            info = grad_scan.with_rerun(info, first_named(located[0]))
        elif abs(stats.step - self._scanned) > GAP:  # the console prints this one in full
            loc = locate(trainer, pl_module, self._batches, self._positions)
            info = grad_scan.with_rerun(info, loc)
        self._scanned = stats.step
        for e in events:
            if e.monitor in LOCALIZED or e.kind == ROLLBACK:
                e.extra["grad_scan"] = info
            if e.monitor in LOCALIZED:
                e.message += f"; {grad_scan.describe(info)}"

    def _classify(self, trainer, pl_module, bad: list[Event]) -> None:
        """Replay the step (on the event only): the fault's class, for the remedy, and where
        a non-finite value started. Localized every time when rolled back; without
        rollback, the first time only (a run left to go on would replay every step after)."""
        fault = bad[0]
        nonfinite = next((e for e in bad if e.monitor in LOCALIZED), None)
        localize = nonfinite is not None and (self.rollback_on or not self._localized)
        classify = self.rollback_on and self.rcfg.classify and "class" not in fault.extra
        if not (localize or classify) or _sharded(trainer):  # the replay needs whole grads
            return
        info = self.classifier(
            trainer,
            pl_module,
            fault,
            self.probe,
            self._detailed,
            self._batches,
            self._positions,
            classify=classify,
            localize=localize,
        )
        if localize:
            nonfinite.extra["localization"] = info.pop("localization")
            self._localized = True
        fault.extra.update(info)

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
            "transients": dict(self.controller.transients),
        }

    def load_state_dict(self, state: dict) -> None:
        self.suite.load_state_dict(state["monitors"])
        self.policy.load_state_dict(state["policy"])
        self.counts.update(state["counts"])
        self.controller.transients.update(state.get("transients", {}))
        self._fault_state = state.get("fault")
        if self.injector is not None and self._fault_state:  # Lightning restores after setup
            self.injector.load_state_dict(self._fault_state)
