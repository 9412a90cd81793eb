"""The stability engine: the step protocol every loop adapter drives (docs/design-engine.md).

It owns what decides: the probe, the step's gather and its one host sync, the monitors,
the re-run classification with NaN localization (classify.py, localize.py), the gradient
scan, the repro bundle, the snapshot ring and the rollback with its remedy
(controller.py), the events (sink.py). It reads the loop only through ``Loop``
(loop.py) and the model and its data only through ``Host`` (host.py): no Trainer here.

An adapter calls, in this order, per optimizer step: ``micro_batch(batch)`` before each
micro-batch's forward, ``after_backward()`` after each backward, ``judge()`` after the
last backward and before the optimizer step, ``step_end()`` after the step (or its skip);
``setup()`` / ``start()`` once, ``close()`` or ``fail()`` at the end, ``state_dict()`` /
``load_state_dict()`` with the loop's checkpoints. Every rank runs the same monitors on
the same numbers and takes the same decision: warn, snapshot, roll back with a remedy, or
abort with a diagnosis.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stabilize.data import parse_skip_items
from stabilize.faults import FaultConfig, FaultInjector
from stabilize.monitors import ROLLBACK, Event, MonitorConfig, MonitorSuite, StepStats
from stabilize.rollback import RollbackConfig
from stabilize.rollback.sharded import Sharder
from stabilize.stability import grad_scan
from stabilize.stability.bundle import write_bundle
from stabilize.stability.classify import LOCALIZED, Classifier
from stabilize.stability.console import GAP
from stabilize.stability.controller import RollbackController, load_skipped, load_skipped_items
from stabilize.stability.curvature import curvature_pass, stability_lines
from stabilize.stability.gather import HEAD, StepGather
from stabilize.stability.host import Host
from stabilize.stability.localize import first_named, locate
from stabilize.stability.loop import Loop, every_rank, my_rank
from stabilize.stability.probe import StabilityProbe
from stabilize.stability.quant_sites import SERIES as QUANT_SERIES
from stabilize.stability.sink import EventSink
from stabilize.stability.view import norm_summary, view_of


class StabilityEngine:
    def __init__(
        self,
        monitor: MonitorConfig,
        rollback: RollbackConfig,
        fault: FaultConfig,
        run_dir: str | Path | None,
        accumulate: int = 1,
        *,
        skip_items: Iterable[str] = (),
        layer_panels: int = 24,
    ):
        """Settings checked (arguments.py); ``run_dir`` may be ``settle``d before ``setup``."""
        self.mcfg, self.rcfg, self.fcfg = monitor, rollback, fault
        # without monitors nothing can call for a rollback: no snapshots to pay for either
        self.rollback_on = rollback.enabled and monitor.enabled
        self.run_dir = Path(run_dir) if run_dir is not None else Path(".")
        self.skip_items = list(skip_items)
        self.suite = MonitorSuite(monitor)
        # a monitor that reads a log-step-only series gets it on every step
        self.detailed_always = bool(self.suite.needs & StabilityProbe.DETAILED_ONLY)
        self.sink = EventSink(self.run_dir, self.rollback_on, layer_panels)
        self.controller = RollbackController(rollback, self.run_dir, self.suite, self.sink)
        self.gather = StepGather(accumulate)
        self.classifier = Classifier(self.gather, self.suite)
        rep = monitor.replicas
        self.replicas_every = rep.every if monitor.enabled and rep.enabled else 0
        self.loop: Loop | None = None
        self.host: Host | None = None
        self.probe: StabilityProbe | None = None
        self.injector: FaultInjector | None = None
        self.last: StepStats | None = None
        self.pending: tuple | None = None  # (stats, events, the fault or None) until step_end
        self.batches: list = []  # the step's fresh micro-batches, and their data positions
        self.positions: list[int] = []
        self._fault_state: dict | None = None  # a checkpoint's, loaded before setup
        self._scanned = -(GAP + 1)  # the step whose gradients were last scanned
        self._bundled: set[str] = set()  # monitors bundled already (rollback off: once each)
        self._bundled_note = False  # the "no bundle: sharded" line, said once
        self._detailed = False
        self._localized = False

    def settle(self, run_dir: str | Path, accumulate: int) -> None:
        """The run dir and the accumulation, once the loop has said them."""
        self.run_dir = self.sink.run_dir = self.controller.run_dir = Path(run_dir)
        self.gather.accumulate = accumulate

    # ---- the parts' names, as tests and benchmarks reach for them ------------------------
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
    def setup(self, loop: Loop, host: Host, blocks: str | None = None,
              describe: bool = False) -> None:  # fmt: skip
        """The fault's hook, the skipped data, the probe, the snapshots' sharding; then the
        run dir is made (every setting settled: the first thing written). ``describe``:
        print once what the probe sees on the model and what it cannot (a user's model)."""
        self.loop, self.host = loop, host
        model = host.model
        # The fault's hook first: hooks run in registration order, and the probe must
        # measure what the next layer really receives.
        self.injector = FaultInjector(self.fcfg, rank=loop.rank)
        self.injector.attach(model)
        host.injector = self.controller.injector = self.injector
        if self._fault_state:  # resumed: loaded before this runs
            self.injector.load_state_dict(self._fault_state)
        # a data-linked fault's batches stay skipped across launches (in place: the
        # sampler shares the set), and the sequences of stabilize-replay --data or
        # data.skip_items
        host.train_state.skipped |= load_skipped(self.run_dir)
        items = host.train_state.skipped_items
        items.update(parse_skip_items(self.skip_items))
        items.update(load_skipped_items(self.run_dir))
        if self.mcfg.enabled:
            view = view_of(model, blocks)
            self.probe = StabilityProbe(view, lead=HEAD)
            self.probe.quant_always = bool(self.suite.needs & QUANT_SERIES)
            if describe and loop.is_zero:
                for line in view.lines:
                    print(f"[stability] {line}", flush=True)
        # DDP replicas hold the same state: each rank snapshots 1/world of it (sharded.py)
        world = loop.replicas
        self.controller.sharder = Sharder(loop.rank, world, fsdp=loop.fsdp)
        self.controller.sharder.host_async = self.rcfg.copy_async
        if world > 1 and self.rollback_on and loop.is_zero:
            print(f"[stability] snapshots sharded: each of {world} ranks keeps 1/{world}",
                  flush=True)  # fmt: skip
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Training starts: the fault reads the dataset; a floor to return to is taken."""
        self.injector.bind_data(self.host.train_dataset())
        if self.rollback_on:
            self.snapshot()

    def write_run_info(self) -> None:
        """``config.json`` for a loop that is not stabilize-train's: the settings, the
        precision and the norms' reduction as the report's table reads them, and how the
        module is rebuilt (rank 0)."""
        if self.loop.is_zero:
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

    def write_result(self, status: str, error: str | None = None) -> None:
        """``result.json``: how the run ended and at which steps (rank 0)."""
        if self.loop.is_zero:
            ts = self.host.train_state
            result = {"status": status, "model_step": ts.model_step,
                      "global_step": self.loop.step, "error": error,
                      "remedies": list(ts.remedies)}  # fmt: skip
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))

    def close(self) -> None:
        """The end of training: open episodes summed up; the last durable snapshot on disk."""
        self.sink.close(self.loop)
        self.writer.wait()

    def fail(self) -> None:
        """An abort or a crash: the durable snapshot in flight is still written (it
        predates the fault); the loop's own error is the one that goes on."""
        if self.loop is None:  # refused in set-up: nothing was started
            return
        self.sink.close(self.loop)
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001  (the training error is the one to report)
            if self.loop.is_zero:
                print(f"[stability] the durable snapshot in flight failed too: {e!r}", flush=True)

    # ---- per step -------------------------------------------------------------------------
    def micro_batch(self, batch) -> None:
        """Before a micro-batch's forward. The first fresh one of an optimizer step opens
        the probe's window (not data_step % accumulate: a skip_data remedy may move the
        position by any number of micro-batches); every fresh one is kept for a re-run
        and a bundle."""
        host, loop = self.host, self.loop
        if host.window_start and self.probe is not None:
            # this step is logged iff the loop's step after it is a multiple of the interval
            logged = (loop.step + 1) % loop.log_every == 0
            self._detailed = logged or self.detailed_always
            self.probe.reset(detailed=self._detailed, device=host.device, logged=logged)
        if host.window_start:
            self.batches, self.positions = [], []
        if not host.stale_batch:
            self.batches.append(batch)
            self.positions.append(host.train_state.data_step)

    def after_backward(self) -> None:
        """After each backward, before anything may write a parameter: the durable copy of
        the last snapshot's state has landed."""
        self.controller.sharder.fence()

    def judge(self) -> tuple | None:
        """After the last backward, gradients unscaled, nothing applied: the gather, the
        monitors, and on a fault the re-run, the scan and the bundle. A bad step is made
        a no-op (gradients dropped, ``train_state.skip_step``); the restore waits for
        ``step_end``, after the loop's own step bookkeeping. Returns (stats, events, the
        fault or None), or None when nothing was judged."""
        host = self.host
        if host.stale_batch or not (self.mcfg.enabled or self.rollback_on):
            return None
        optimizer = self.loop.optimizer()
        stats = self.gather_step()
        events = self.suite.update(stats)
        self.last = stats
        nonfinite = stats.grad_norm is not None and not math.isfinite(stats.grad_norm)
        bad = [e for e in events if e.kind == ROLLBACK]
        if bad:
            over = [e.layer for e in bad if e.monitor == "overflow"]
            if over:  # every norm that overflowed at this step (the fp32_sites remedy)
                bad[0].extra["overflowed"] = over
            clipped = sorted({e.extra["site"] for e in bad if "site" in e.extra})
            if clipped:  # every quantized Linear that clipped (the quant_bf16 remedy)
                bad[0].extra["sites"] = clipped
            self._classify(bad)
        if nonfinite and not self.loop.sharded:  # sharded: each rank holds a shard's grads
            self._scan_grads(stats, events)
        self._bundle(stats, events, bad)
        if bad and self.rollback_on:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is applied
            host.train_state.skip_step = True
        self.pending = (stats, events, bad[0] if bad and self.rollback_on else None)
        return self.pending

    def step_end(self) -> None:
        """After the optimizer step (the loop's step counted): the step's logs and events,
        then the rollback or the snapshot."""
        if self.host.stale_batch or self.pending is None:
            return  # a stale batch, or mid-accumulation: no optimizer step was judged
        stats, events, fault = self.pending
        self.pending = None
        loop = self.loop
        # the step's scalars every step, the per-layer series on log steps (sink.py) and on a
        # step whose gradients were scanned (their per-block norms, inf / nan kept)
        log_step = loop.step % loop.log_every == 0
        self.log_stats(stats, log_step or self._scanned == stats.step, news=bool(events))
        for e in events:
            self.sink.emit(loop, e)
        if fault is not None:
            self.rollback(fault)
        elif self.rollback_on and self.host.train_state.model_step % self.rcfg.snapshot_every == 0:
            self.snapshot()

    # ---- the parts (methods, so that a benchmark can time each one) ------------------------
    def gather_step(self) -> StepStats:
        """One vector, one collective, one host transfer (with every rank's parameter
        fingerprint every ``monitor.replicas.every`` steps)."""
        loop, host = self.loop, self.host
        optimizer = loop.optimizer()
        n = 0 if loop.sharded else self.replicas_every  # shards differ by design
        due = bool(n) and loop.world > 1 and (host.train_state.model_step + 1) % n == 0
        curv = self._curvature(optimizer)
        stats = self.gather(loop, host, optimizer, self.probe, replicas=due, curvature=curv)
        if "curv_u" in stats.opt:  # the lines it is read against, at this step's lr
            g = optimizer.param_groups[0]
            edge_gd, edge_adam = stability_lines(g["lr"], g["betas"][0])
            stats.opt.update(edge_gd=edge_gd, edge_adam=edge_adam)
        return stats

    def _curvature(self, optimizer):
        """The curvature pass, on one log step in ``monitor.curvature.every`` (None else)."""
        c = self.mcfg.sections.get("curvature")
        if self.probe is None or not self.probe.logged or c is None or not c.enabled:
            return None
        if not c.every or ((self.loop.step + 1) // self.loop.log_every) % c.every:
            return None
        return curvature_pass(self.loop, self.host, optimizer, self.batches, self.positions,
                              c.rel)  # fmt: skip

    def _bundle(self, stats, events: list[Event], bad: list[Event]) -> None:
        """A repro bundle of the step (bundle.py), before anything is restored. Every rank
        takes the same decision (same events), as the gather of the batches needs."""
        mode, loop = self.rcfg.bundle, self.loop
        worth = bad if mode == "fault" else [e for e in events if e.kind != "info"]
        if not self.rollback_on:  # nothing is undone: a monitor's first verdict is the evidence
            worth = [e for e in worth if e.monitor not in self._bundled]
            self._bundled |= {e.monitor for e in worth}
        if mode == "off" or not worth:
            return
        if loop.sharded and not loop.fsdp:  # a module that shards itself: no one copy
            if not self._bundled_note and loop.is_zero:
                print("[bundle] no repro bundle: the parameters are sharded", flush=True)
            self._bundled_note = True
            return
        # a step rolled back before (another rung) gets its own dir, never the first's: the
        # count is the policy's history, the same on every rank and kept in checkpoints
        attempt = 1 + sum(h["fault_step"] == stats.step for h in self.policy.history)
        write_bundle(loop, self.host, stats, worth, self.batches, self.positions, self.rcfg,
                     self.run_dir, sharded=loop.fsdp, attempt=attempt)  # fmt: skip

    def _scan_grads(self, stats: StepStats, events: list[Event]) -> None:
        """A non-finite gradient norm (a NaN or inf, an fp16 scaler skip): where it was made
        (grad_scan.py). The localization of a ROLLBACK verdict's replay where there is one
        (``_classify`` ran first); else, on the first non-finite step of an episode, the step
        re-run with hooks; the step's own gradients scanned once in any case. The module
        goes into the verdict's message (the console), its extra (events.jsonl,
        diagnosis.json) and the step's logs."""
        view = self.probe.view if self.probe is not None else None
        info = grad_scan.scan(self.host.model, loss_finite=math.isfinite(stats.loss), view=view)
        stats.layer_grad_norm = {**stats.layer_grad_norm, **info.pop("block_grad_norm")}
        located = [e.extra["localization"] for e in events if "localization" in e.extra]
        if located:
            info = grad_scan.with_rerun(info, first_named(located[0]))
        elif abs(stats.step - self._scanned) > GAP:  # the console prints this one in full
            loc = locate(self.loop, self.host, self.batches, self.positions)
            info = grad_scan.with_rerun(info, loc)
        self._scanned = stats.step
        for e in events:
            if e.monitor in LOCALIZED or e.kind == ROLLBACK:
                e.extra["grad_scan"] = info
            if e.monitor in LOCALIZED:
                e.message += f"; {grad_scan.describe(info)}"

    def _classify(self, bad: list[Event]) -> None:
        """Replay the step (on the event only): the fault's class, for the remedy, and where
        a non-finite value started. Localized every time when rolled back; without
        rollback, the first time only (a run left to go on would replay every step after)."""
        fault = bad[0]
        nonfinite = next((e for e in bad if e.monitor in LOCALIZED), None)
        localize = nonfinite is not None and (self.rollback_on or not self._localized)
        classify = self.rollback_on and self.rcfg.classify and "class" not in fault.extra
        if not (localize or classify) or self.loop.sharded:  # the replay needs whole grads
            return
        info = self.classifier(self.loop, self.host, fault, self.probe, self._detailed,
                               self.batches, self.positions, classify=classify,
                               localize=localize)  # fmt: skip
        if localize:
            nonfinite.extra["localization"] = info.pop("localization")
            self._localized = True
        fault.extra.update(info)

    def log_stats(self, s: StepStats, layers: bool = True, news: bool = True) -> None:
        dims = self.probe.dims if self.probe is not None else None
        self.sink.log_stats(self.loop, s, self.suite.forecast, dims, layers, news)

    def snapshot(self) -> None:
        self.controller.snapshot(self.loop, self.host)

    def restore(self, st: dict) -> None:
        """Load a snapshot's state into the live model, optimizer, scheduler, scaler and
        monitors (no remedy, no data seek)."""
        self.controller.restore(self.loop, self.host, st)

    def rollback(self, event: Event) -> None:
        self.controller.rollback(self.loop, self.host, event, self.last)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A resumed run keeps its monitors' windows, its rollback history (the ladder) and
        its fault's course. A collective under DDP (each rank's own fault course)."""
        fault = self.injector.state_dict() if self.injector else None
        return {
            "monitors": self.suite.state_dict(),
            "policy": self.policy.state_dict(),
            "counts": dict(self.counts),
            "fault": fault,
            # each rank's own course: a fault measures its rank's batch (a drift's starting
            # level), and rank 0's alone in the file put rank 0's on every rank at a resume
            "fault_ranks": every_rank(fault),
            "transients": dict(self.controller.transients),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.suite.load_state_dict(state["monitors"])
        self.policy.load_state_dict(state["policy"])
        self.counts.update(state["counts"])
        self.controller.transients.update(state.get("transients", {}))
        self._fault_state = my_rank(state.get("fault_ranks")) or state.get("fault")
        if self.injector is not None and self._fault_state:  # restored after setup
            self.injector.load_state_dict(self._fault_state)
