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

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from stabilize.data import parse_skip_items
from stabilize.faults import FaultConfig, FaultInjector
from stabilize.lit.arguments import check_callback, settings, watched
from stabilize.lit.fsdp import is_fsdp
from stabilize.lit.host import LightningHost, module_path
from stabilize.monitors import ROLLBACK, Event, MonitorConfig, MonitorSuite, StepStats
from stabilize.rollback import RollbackConfig
from stabilize.rollback.sharded import Sharder
from stabilize.rollback.state import TrainState
from stabilize.stability import grad_scan
from stabilize.stability.bundle import write_bundle
from stabilize.stability.classify import LOCALIZED, Classifier
from stabilize.stability.console import GAP
from stabilize.stability.controller import (
    RollbackController,
    StabilityAbort,
    load_skipped,
    load_skipped_items,
)
from stabilize.stability.curvature import curvature_pass, stability_lines
from stabilize.stability.gather import HEAD, StepGather
from stabilize.stability.localize import first_named, locate
from stabilize.stability.probe import StabilityProbe
from stabilize.stability.sink import EventSink
from stabilize.stability.view import norm_summary, view_of


def _every_rank(value) -> list | None:
    """``value`` of every rank, in rank order (None on one process). A collective: Lightning
    calls a callback's ``state_dict`` on every rank at every checkpoint save."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _my_rank(values: list | None):
    """This rank's entry of ``_every_rank``'s list (None: not saved, or another world)."""
    dist = torch.distributed
    if not values or not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    return values[rank] if len(values) == dist.get_world_size() else None


def _sharded(trainer) -> bool:
    """FSDP2 (``trainer.strategy=fsdp``), or a module that clips sharded gradients itself:
    parameters and gradients are shards (no replay, no replica fingerprint)."""
    return is_fsdp(trainer.strategy) or hasattr(trainer.strategy.model, "clip_grad_norm_")


class StabilityCallback(L.Callback):
    def __init__(
        self,
        monitor: MonitorConfig | dict | None = None,
        rollback: RollbackConfig | dict | None = None,
        fault: FaultConfig | dict | None = None,
        run_dir: str | Path | None = None,
        accumulate: int | None = None,
        *,
        model: nn.Module | str | None = None,
        blocks: str | None = None,
        skip_items: Iterable[str] | str = (),
        factory: str | None = None,
        layer_panels: int = 24,
    ):
        """Settings as the ``stabilize-train`` groups (``monitor``, ``rollback``, ``fault``):
        a dataclass, a dict of its keys, or None for the defaults. ``run_dir``: where
        events, bundles and snapshots go (default: the Trainer's log dir). ``accumulate``:
        default the Trainer's ``accumulate_grad_batches``. For a LightningModule we did not
        write (docs/your-model.md): ``model``, the network to watch (a module or an
        attribute path; default the child holding every parameter), ``blocks``, a glob
        naming its residual blocks (default the longest ModuleList), ``factory``,
        ``pkg.mod:fn`` that rebuilds the module for ``stabilize-replay`` (default its
        class with its saved ``hparams``). ``skip_items``: ``data.skip_items``.
        ``layer_panels``: ``logger.layer_panels`` (stability/wandb_layers.py)."""
        # every argument checked before anything is made (arguments.py: one line each)
        monitor, rollback, fault = settings(monitor, rollback, fault)
        skip_items = check_callback(run_dir, accumulate, model, blocks, factory, skip_items)
        self.mcfg, self.rcfg, self.fcfg = monitor, rollback, fault
        # without monitors nothing can call for a rollback: no snapshots to pay for either
        self.rollback_on = rollback.enabled and monitor.enabled
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.accumulate = accumulate
        self._model, self._blocks, self.factory = model, blocks, factory
        self.skip_items = skip_items
        self.host = None  # GPTLitModule itself, or a LightningHost (set up in setup)
        self._driven = False  # the host is a LightningHost: this callback drives it
        self._budget = -1  # a foreign module's max_steps, counted in model steps
        self.suite = MonitorSuite(monitor)
        # a monitor that reads a log-step-only series gets it on every step
        self._detailed_always = bool(self.suite.needs & StabilityProbe.DETAILED_ONLY)
        self.sink = EventSink(run_dir or ".", self.rollback_on, layer_panels)
        self.controller = RollbackController(rollback, run_dir or ".", self.suite, self.sink)
        self.gather = StepGather(accumulate or 1)
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
        if stage != "fit":
            return
        self._own_host(trainer, pl_module)  # a module or a setting refused here makes no dir
        model = self.host.model
        # The fault's hook first: hooks run in registration order, and the probe must
        # measure what the next layer really receives.
        self.injector = FaultInjector(self.fcfg, rank=trainer.global_rank)
        self.injector.attach(model)
        self.host.injector = self.controller.injector = self.injector
        if getattr(self, "_fault_state", None):  # resumed: loaded before this runs
            self.injector.load_state_dict(self._fault_state)
        # a data-linked fault's batches stay skipped across launches (in place: the
        # sampler shares the set)
        self.host.train_state.skipped |= load_skipped(self.run_dir)
        # and the sequences found by stabilize-replay --data, or named in data.skip_items
        items = self.host.train_state.skipped_items
        items.update(parse_skip_items(self.skip_items))
        items.update(load_skipped_items(self.run_dir))
        if self.mcfg.enabled:
            view = view_of(model, self._blocks)
            self.probe = StabilityProbe(view, lead=HEAD)
        # DDP replicas hold the same state: each rank snapshots 1/world of it (sharded.py)
        world = trainer.world_size if isinstance(trainer.strategy, DDPStrategy) else 1
        fsdp = is_fsdp(trainer.strategy)  # each rank's state is its shard already
        self.controller.sharder = Sharder(trainer.global_rank, world, fsdp=fsdp)
        if world > 1 and self.rollback_on:
            rank_zero_info(f"[stability] snapshots sharded: each of {world} ranks keeps 1/{world}")
        self.run_dir.mkdir(parents=True, exist_ok=True)  # all settled: the first thing written

    def _own_host(self, trainer, pl_module) -> None:
        """Our GPTLitModule is its own host; any other LightningModule gets a
        LightningHost (lit/host.py). The run dir, accumulation and budget are settled."""
        if self.run_dir is None:
            self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self.sink.run_dir = self.controller.run_dir = self.run_dir
        if self.accumulate is None:
            self.accumulate = self.gather.accumulate = int(trainer.accumulate_grad_batches)
        if self.host is not None:  # given (stabilize.Guard's)
            return
        if isinstance(getattr(pl_module, "train_state", None), TrainState):
            self.host, self._driven = pl_module, False
            return
        model = watched(pl_module, self._model, self.fcfg)
        self.host = LightningHost(pl_module, trainer, model, self.rcfg, self.factory)
        self._driven = True
        if getattr(self, "_host_state", None):  # a checkpoint's state loaded before setup
            self.host.load(self._host_state)
        where = module_path(pl_module)
        if where.startswith("__main__:") and self.factory is None and trainer.is_global_zero:
            print(f"[stability] {where} is defined in a script: its repro bundles cannot be "
                  "replayed in another process (move it to a module, or give "
                  "StabilityCallback(factory='pkg.mod:fn'))", flush=True)  # fmt: skip
        if trainer.max_steps > 0:  # the model's steps, not Lightning's (which never rewind)
            self._budget = trainer.max_steps
            trainer.fit_loop.epoch_loop.max_steps = -1

    def on_train_start(self, trainer, pl_module):
        if self._driven:  # one optimizer: Lightning's automatic optimization allows no more
            self.host.start()
            self.write_run_info(trainer)
        self.injector.bind_data(self.host.train_dataset())
        if self.rollback_on:
            self._snapshot(trainer, self.host)  # a floor to return to, before any step

    def on_train_end(self, trainer, pl_module):
        self.sink.close(trainer)
        self.writer.wait()  # the last durable snapshot is on disk before fit returns
        if self._driven:
            self._write_result(trainer, "done")

    def on_exception(self, trainer, pl_module, exception):
        # an abort or a crash: the durable snapshot in flight is still written (it predates
        # the fault), then the original exception goes on
        self.sink.close(trainer)
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001  (the training error is the one to report)
            rank_zero_info(f"[stability] the durable snapshot in flight failed too: {e!r}")
        if self._driven and self.run_dir.is_dir():  # not a set-up refused before the dir
            aborted = isinstance(exception, StabilityAbort)
            self._write_result(trainer, "aborted" if aborted else "failed", repr(exception))

    # ---- what a run dir holds for stabilize-report, for a loop that is not stabilize-train's
    def write_run_info(self, trainer) -> None:
        """``config.json``: the settings, the precision and the norms' reduction as the
        report's table reads them, and how the module is rebuilt (rank 0)."""
        if trainer.is_global_zero:
            info = {
                "precision": {"name": self.host.precision_name},
                "norm": norm_summary(self.host.model),
                "monitor": self.mcfg.to_dict(),
                "rollback": dataclasses.asdict(self.rcfg),
                "fault": dataclasses.asdict(self.fcfg),
                "host": self.host.host_info(),
            }
            text = json.dumps(info, indent=1, default=str)
            (self.run_dir / "config.json").write_text(text)

    def _write_result(self, trainer, status: str, error: str | None = None) -> None:
        """``result.json``: how the run ended and at which steps (rank 0)."""
        if trainer.is_global_zero:
            ts = self.host.train_state
            result = {"status": status, "model_step": ts.model_step,
                      "global_step": trainer.global_step, "error": error,
                      "remedies": list(ts.remedies)}  # fmt: skip
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))

    def teardown(self, trainer, pl_module, stage):
        self.writer.close()

    # ---- per step -----------------------------------------------------------------------
    # The verdict is reached in on_before_optimizer_step: gradients are unscaled and the
    # loss known, but nothing is applied yet. A bad step is then made a no-op (gradients
    # dropped, as torchtitan stops before the optimizer), so the weights the localization
    # replays and the snapshot ring never see it; the restore itself waits for
    # on_train_batch_end, after Lightning's step / scaler update / scheduler bookkeeping.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._driven:
            self.host.batch_start()
        # the first fresh micro-batch of an optimizer step (not data_step % accumulate: a
        # skip_data remedy may move the position by any number of micro-batches)
        if self.host.window_start and self.probe is not None:
            # this step is logged iff Lightning's step after it is a multiple of the interval
            logged = (trainer.global_step + 1) % trainer.log_every_n_steps == 0
            self._detailed = logged or self._detailed_always
            self.probe.reset(detailed=self._detailed, device=self.host.device, logged=logged)
        self._batch = batch
        if self.host.window_start:
            self._batches, self._positions = [], []
        if not self.host.stale_batch:
            self._batches.append(batch)
            self._positions.append(self.host.train_state.data_step)

    def on_before_backward(self, trainer, pl_module, loss):
        if self._driven:
            self.host.saw_loss(loss)

    def on_after_backward(self, trainer, pl_module):
        if self._driven:
            self.host.after_backward()
        # Lightning calls this before the module's own hook, where a fault may write a
        # parameter: the durable copy of the last snapshot's state has landed by then
        self.controller.sharder.fence()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._driven:
            self.host.stepping()
        if self.host.stale_batch or not (self.mcfg.enabled or self.rollback_on):
            return
        stats = self._gather(trainer, self.host, optimizer)
        events = self.suite.update(stats)
        self.last = stats
        nonfinite = stats.grad_norm is not None and not math.isfinite(stats.grad_norm)
        bad = [e for e in events if e.kind == ROLLBACK]
        if bad:
            over = [e.layer for e in bad if e.monitor == "overflow"]
            if over:  # every norm that overflowed at this step (the fp32_sites remedy)
                bad[0].extra["overflowed"] = over
            self._classify(trainer, self.host, bad)
        if nonfinite and not _sharded(trainer):  # FSDP: each rank holds a shard's gradients
            self._scan_grads(trainer, self.host, stats, events)
        self._bundle(trainer, self.host, stats, events, bad)
        if bad and self.rollback_on:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is applied
            self.host.train_state.skip_step = True
        self._pending = (stats, events, bad[0] if bad and self.rollback_on else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._driven:
            self.host.step_end(self._batches, self._positions)
            self._judge_end(trainer)
            if 0 < self._budget <= self.host.train_state.model_step:
                trainer.should_stop = True
            return
        self._judge_end(trainer)

    def _judge_end(self, trainer) -> None:
        """After the optimizer step: the step's logs and events, then the rollback or the
        snapshot."""
        if self.host.stale_batch or self._pending is None:
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
            self._rollback(trainer, self.host, fault)
        elif self.rollback_on and self.host.train_state.model_step % self.rcfg.snapshot_every == 0:
            self._snapshot(trainer, self.host)

    # ---- the parts (methods, so that a benchmark can time each one) ------------------------
    def _gather(self, trainer, host, optimizer) -> StepStats:
        """One vector, one collective, one host transfer (with every rank's parameter
        fingerprint every ``monitor.replicas.every`` steps)."""
        n = 0 if _sharded(trainer) else self.replicas_every  # shards differ by design
        due = bool(n) and trainer.world_size > 1 and (host.train_state.model_step + 1) % n == 0
        curv = self._curvature(trainer, host, optimizer)
        stats = self.gather(trainer, host, optimizer, self.probe, replicas=due, curvature=curv)
        if "curv_u" in stats.opt:  # the lines it is read against, at this step's lr
            g = optimizer.param_groups[0]
            edge_gd, edge_adam = stability_lines(g["lr"], g["betas"][0])
            stats.opt.update(edge_gd=edge_gd, edge_adam=edge_adam)
        return stats

    def _curvature(self, trainer, host, optimizer):
        """The curvature pass, on one log step in ``monitor.curvature.every`` (None else)."""
        c = self.mcfg.sections.get("curvature")
        if self.probe is None or not self.probe.logged or c is None or not c.enabled:
            return None
        if not c.every or ((trainer.global_step + 1) // trainer.log_every_n_steps) % c.every:
            return None
        return curvature_pass(trainer, host, optimizer, self._batches, self._positions, c.rel)

    def _bundle(self, trainer, host, stats, events: list[Event], bad: list[Event]) -> None:
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
        # a step rolled back before (another rung) gets its own dir, never the first's: the
        # count is the policy's history, the same on every rank and kept in checkpoints
        attempt = 1 + sum(h["fault_step"] == stats.step for h in self.policy.history)
        write_bundle(trainer, host, stats, worth, self._batches, self._positions, self.rcfg,
                     self.run_dir, sharded=fsdp, attempt=attempt)  # fmt: skip

    def _scan_grads(self, trainer, host, stats: StepStats, events: list[Event]) -> None:
        """A non-finite gradient norm (a NaN or inf, an fp16 scaler skip): where it was made
        (grad_scan.py). The localization of a ROLLBACK verdict's replay where there is one
        (``_classify`` ran first); else, on the first non-finite step of an episode, the step
        re-run with hooks; the step's own gradients scanned once in any case. The module
        goes into the verdict's message (the console), its extra (events.jsonl,
        diagnosis.json) and the step's logs."""
        view = self.probe.view if self.probe is not None else None
        info = grad_scan.scan(host.model, loss_finite=math.isfinite(stats.loss), view=view)
        stats.layer_grad_norm = {**stats.layer_grad_norm, **info.pop("block_grad_norm")}
        located = [e.extra["localization"] for e in events if "localization" in e.extra]
        if located:
            info = grad_scan.with_rerun(info, first_named(located[0]))
        elif abs(stats.step - self._scanned) > GAP:  # the console prints this one in full
            loc = locate(trainer, host, self._batches, self._positions)
            info = grad_scan.with_rerun(info, loc)
        self._scanned = stats.step
        for e in events:
            if e.monitor in LOCALIZED or e.kind == ROLLBACK:
                e.extra["grad_scan"] = info
            if e.monitor in LOCALIZED:
                e.message += f"; {grad_scan.describe(info)}"

    def _classify(self, trainer, host, bad: list[Event]) -> None:
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
            host,
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

    def _snapshot(self, trainer, host) -> None:
        self.controller.snapshot(trainer, host)

    def restore(self, trainer, host, st: dict) -> None:
        """Load a snapshot's state into the live model, optimizer, scheduler, scaler and
        monitors (no remedy, no data seek)."""
        self.controller.restore(trainer, host, st)

    def _rollback(self, trainer, host, event: Event) -> None:
        self.controller.rollback(trainer, host, event, self.last)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: a resumed run keeps its monitors' windows, its
        rollback history (the ladder) and its fault's course."""
        fault = self.injector.state_dict() if self.injector else None
        return {
            "monitors": self.suite.state_dict(),
            "policy": self.policy.state_dict(),
            "counts": dict(self.counts),
            "fault": fault,
            # each rank's own course: a fault measures its rank's batch (a drift's starting
            # level), and rank 0's alone in the file put rank 0's on every rank at a resume
            "fault_ranks": _every_rank(fault),
            "transients": dict(self.controller.transients),
            # a module we did not write: its model steps and data position are ours to keep
            "host": self.host.saved() if self._driven else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.suite.load_state_dict(state["monitors"])
        self.policy.load_state_dict(state["policy"])
        self.counts.update(state["counts"])
        self.controller.transients.update(state.get("transients", {}))
        self._fault_state = _my_rank(state.get("fault_ranks")) or state.get("fault")
        self._host_state = state.get("host")
        if self._driven and self._host_state:  # Lightning restores after setup
            self.host.load(self._host_state)
        if self.injector is not None and self._fault_state:  # Lightning restores after setup
            self.injector.load_state_dict(self._fault_state)
