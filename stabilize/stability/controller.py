"""The rollback controller: snapshots, restore, the remedy, and the abort.

Healthy steps are snapshotted into the memory ring (every ``rollback.snapshot_every``; to
disk every ``durable_every``, on a background thread). On a ROLLBACK verdict the policy
picks a snapshot and a remedy (or gives up); the controller restores the snapshot into the
live model, optimizer, scheduler, scaler and monitors, calls the remedy
(stabilize/rollback/remedies.py) and seeks the data. Giving up raises ``StabilityAbort``
with a diagnosis (also written to ``diagnosis.json``); the CLI exits with code 3.

The remedy follows the fault's class (``event.extra["class"]``, classify.py): transient
faults are counted per rank (``transients``), and the batches a data-linked fault was found
in are written to ``skipped_batches.json`` (``SKIPPED``) so that a resume skips them too.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from stabilize.faults import FaultInjector
from stabilize.io import atomic_write_text
from stabilize.monitors import Event, MonitorSuite, StepStats
from stabilize.rollback import (
    DurableWriter,
    RollbackConfig,
    RollbackPolicy,
    Snapshot,
    SnapshotRing,
    get_remedy,
    to_cpu,
)
from stabilize.rollback.sharded import Sharder
from stabilize.stability.sink import EventSink

SKIPPED = "skipped_batches.json"  # the data positions never to train on (run/rundir.py)


def load_skipped(run_dir: str | Path) -> set[int]:
    """The data positions a run dir's ``skipped_batches.json`` lists (none: empty)."""
    path = Path(run_dir) / SKIPPED
    if not path.exists():
        return set()
    return {int(b["data_step"]) for b in json.loads(path.read_text())["batches"]}


SKIPPED_ITEMS = "skipped_items.json"  # sequences never to train on (stabilize-replay --data)


def load_skipped_items(run_dir: str | Path) -> dict[int, str]:
    """The sequences (block index -> content hash) a run dir's ``skipped_items.json`` lists."""
    path = Path(run_dir) / SKIPPED_ITEMS
    if not path.exists():
        return {}
    return {int(e["index"]): e["hash"] for e in json.loads(path.read_text())["items"]}


def add_skipped_items(run_dir: str | Path, entries: list[dict[str, Any]]) -> Path:
    """Add sequences (each with ``index`` and ``hash``) to the run dir's
    ``skipped_items.json``, atomically; the entries already there stay."""
    path = Path(run_dir) / SKIPPED_ITEMS
    have = json.loads(path.read_text())["items"] if path.exists() else []
    known = {(e["index"], e["hash"]) for e in have}
    new = [e for e in entries if (e["index"], e["hash"]) not in known]
    atomic_write_text(path, json.dumps({"items": have + new}, indent=1))
    return path


class StabilityAbort(RuntimeError):
    """Raised on every rank at once when the policy gives up; carries the diagnosis."""

    def __init__(self, diagnosis: dict[str, Any]):
        super().__init__(diagnosis["reason"])
        self.diagnosis = diagnosis


class RollbackController:
    def __init__(
        self, cfg: RollbackConfig, run_dir: str | Path, suite: MonitorSuite, sink: EventSink
    ):
        self.cfg, self.run_dir, self.suite, self.sink = cfg, Path(run_dir), suite, sink
        self.ring = SnapshotRing(cfg.keep)
        self.writer = DurableWriter(background=cfg.durable_async, keep=cfg.keep_durable)
        self.policy = RollbackPolicy(cfg)
        self.injector: FaultInjector | None = None  # set by the callback's setup
        self.sharder = Sharder()  # world 1: full copies; set per world by the callback
        self.transients: Counter[int] = Counter()  # transient faults, per rank

    @staticmethod
    def _objects(loop):
        """The optimizer, every LR scheduler (none, one or more) and the loss scaler."""
        return loop.optimizer(), loop.schedulers(), loop.scaler()

    def snapshot(self, loop, host) -> None:
        opt, scheds, scaler = self._objects(loop)
        # the host buffers of the snapshot leaving the ring are written in place (copy_):
        # no allocation once the ring is full (stabilize.rollback.SnapshotRing)
        old = self.ring.recycle() or {}
        if self.writer.busy_with(old):  # still being written to disk: let it finish first
            self.writer.wait()
        # model + optimizer: full host copies, or this rank's 1/world slice under DDP
        parts = {"model": host.model.state_dict(), "optimizer": opt.state_dict()}
        state = {
            **self.sharder.capture(parts, old, opt),
            "schedulers": [to_cpu(s.state_dict()) for s in scheds],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "model_step": host.train_state.model_step,
            "data_step": host.train_state.data_step,
            "monitors": to_cpu(self.suite.state_dict()),
            "fault": self.injector.snapshot_state() if self.injector else None,
        }
        snap = Snapshot(host.train_state.model_step, state, landed=self.sharder.fence)
        self.ring.push(snap)
        every = self.cfg.durable_every
        if every and snap.step % every == 0:  # rank 0 the whole state; FSDP: every shard
            d = self.run_dir / "snapshots"
            self.sharder.write_durable(snap, parts, self.writer, d, host.model, opt)

    def restore(self, loop, host, st: dict) -> None:
        """Load a snapshot's state into the live model, optimizer, scheduler, scaler and
        monitors (no remedy, no data seek: that is rollback's business)."""
        opt, scheds, scaler = self._objects(loop)
        host.model.load_state_dict(st["model"])  # copies into the parameters
        opt.load_state_dict(st["optimizer"])
        # Optimizer.load_state_dict keeps the snapshot's own tensors wherever no cast or
        # move is needed (every ``step`` counter; on CPU the moments too): the optimizer
        # would then update the snapshot in place, and a second rollback to it, or the
        # next snapshot written into its recycled buffers, would see the live state.
        for per_param in opt.state.values():
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    per_param[k] = v.clone()
        for sched, saved in zip(scheds, st["schedulers"], strict=True):
            sched.load_state_dict(saved)
        if scaler is not None and st["scaler"] is not None:
            scaler.load_state_dict(st["scaler"])
        self.suite.load_state_dict(st["monitors"])

    def rollback(self, loop, host, event: Event, last: StepStats | None) -> None:
        """Restore, remedy and seek for ``event``; or abort. ``last``: the step's stats,
        for a diagnosis."""

        def unchanged(rung: str) -> str | None:
            return get_remedy(rung).unchanged(host.train_state, self.cfg.remedy.get(rung))

        # what the fault touched, before the policy asks a rung whether it would change it
        host.train_state.fault_sites = [*event.extra.get("overflowed", []),
                                         *event.extra.get("sites", [])]  # fmt: skip
        decision = self.policy.decide(event, self.ring, unchanged)
        if decision.action == "abort":
            self.abort(loop, host, event, decision.reason, last)
        snap, remedy = decision.snapshot, decision.remedy
        st = self.sharder.whole(snap.state)  # sharded: one all-gather rebuilds it
        self.restore(loop, host, st)
        if self.injector is not None and st["fault"] is not None:
            self.injector.on_rollback(st["fault"])
        host.train_state.model_step, host.train_state.data_step = (
            st["model_step"],
            st["data_step"],
        )
        cls = event.extra.get("class")
        host.train_state.fault_batches = list(event.extra.get("batches", []))
        host.train_state.fault_items = list(event.extra.get("items", []))
        did = get_remedy(remedy).apply(host.train_state, self.cfg.remedy.get(remedy))
        if decision.skipped:  # rungs that would have changed nothing: said, not applied
            did = {**did, "skipped": {r: why for r, why in decision.skipped}}
        did = {**did, **self._after_rungs(host, decision, remedy)}
        if host.train_state.lr_scale < 1.0:  # a lowered LR's healthy window starts again here
            host.train_state.lr_since = host.train_state.model_step
        if cls == "transient":
            self.transients.update(event.extra.get("ranks", []))
            did = {**did, "transients_per_rank": dict(self.transients)}
        if "skipped_batches" in did:
            self._record_skipped(loop, host)
        if "skipped_items" in did and loop.is_zero:
            found = [{**it, "step": event.step} for it in host.train_state.fault_items]
            add_skipped_items(self.run_dir, found)
        host.apply_lr()  # remedies so far stay applied, on the restored step
        host.train_state.remedies.append(remedy)
        host.seek_data(host.train_state.data_step)
        loop.optimizer().zero_grad(set_to_none=True)
        self.ring.drop_after(snap.step)
        self.sink.emit(
            loop,
            Event(
                "rollback",
                "rollback",
                event.step,
                f"rolled back from step {event.step} to {snap.step} "
                f"({event.monitor}, {cls or 'unclassified'}); remedy {remedy}: {did}",
                layer=event.layer,
                extra={"restored_step": snap.step, "remedy": remedy, "class": cls, **did},
            ),
        )

    def _after_rungs(self, host, decision, remedy: str) -> dict[str, Any]:
        """The rung this fault's last rollback applied did not stop it: undone where it can
        be (a lowered LR), else kept and said why."""
        undone, kept = {}, {}
        for rung in decision.before:
            if rung in (remedy, "retry"):
                continue
            r = get_remedy(rung)
            took = r.undo(host.train_state, self.cfg.remedy.get(rung))
            if took is None:
                kept[rung] = r.kept_because
            else:
                undone[rung] = took
        return {k: v for k, v in (("undone", undone), ("kept", kept)) if v}

    def _record_skipped(self, loop, host) -> None:
        """``skipped_batches.json``: every skipped data position with each rank's item
        indices (rank 0 writes it; a resume reads it back, stability callback's setup)."""
        if not loop.is_zero:
            return
        sampler = host.train_sampler()  # the loop's own
        if sampler is None:  # positions without item indices: nothing to resume from
            return
        batches = [
            {
                "data_step": p,
                "items": [sampler.batch_for_step(p, r) for r in range(loop.world)],
            }
            for p in sorted(host.train_state.skipped)
        ]
        (self.run_dir / SKIPPED).write_text(json.dumps({"batches": batches}, indent=1))

    def abort(self, loop, host, event: Event, reason: str, last: StepStats | None):
        # one tensor, one entry: a block whose output a norm reads is that norm's
        merged = set(last.act_alias) if last else set()
        seen = [kv for kv in (last.act_max.items() if last else ()) if kv[0] not in merged]
        top = sorted(seen, key=lambda kv: -kv[1])[:5]
        forecast = {k: v for k, v in self.suite.forecast.items() if math.isfinite(v)}
        diagnosis = {
            "reason": reason,
            "monitor": event.monitor,
            "step": event.step,
            "layer": event.layer,
            "message": event.message,
            "grad_scan": event.extra.get("grad_scan"),  # where the gradient went non-finite
            "act_max_top": top,
            "forecast_steps_left": dict(sorted(forecast.items(), key=lambda kv: kv[1])[:5]),
            "rollbacks": self.policy.history,
            "remedies": list(host.train_state.remedies),
        }
        self.sink.emit(
            loop,
            Event(
                "abort",
                "rollback",
                event.step,
                f"abort: {reason}",
                layer=event.layer,
                extra={"diagnosis": diagnosis},
            ),
        )
        if loop.is_zero:
            (self.run_dir / "diagnosis.json").write_text(
                json.dumps(diagnosis, indent=2, default=str)
            )
        raise StabilityAbort(diagnosis)
