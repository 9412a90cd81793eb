"""The rollback config and policy: which snapshot, which remedy, or give up.

The policy is deterministic host code fed identical numbers on every rank, so all ranks
decide the same thing without talking to each other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stabilize.monitors.events import Event
from stabilize.rollback.remedies import REMEDIES
from stabilize.rollback.snapshots import Snapshot, SnapshotRing
from stabilize.validate import check_choice, check_positive, check_range


@dataclass
class RollbackConfig:
    """``rollback``: snapshots, the remedy ladder and when to give up."""

    enabled: bool = True
    """Roll every rank back to a good snapshot on a ROLLBACK verdict."""
    snapshot_every: int = 10
    """K: a memory snapshot every K healthy steps."""
    keep: int = 3
    """Snapshots in the memory ring."""
    durable_every: int = 100
    """M: also to disk (run_dir/snapshots) every M steps (0: never)."""
    durable_async: bool = True
    """Write to disk on a background thread (DurableWriter); training goes on meanwhile."""
    copy_async: bool = True
    """A memory snapshot on the host copies the parameters and optimizer state on a thread
    while the next step's forward and backward run (waited for after the backward, before
    anything writes them); buffers a forward may write are copied at once. false: all on
    the training thread, as a loop that writes the parameters itself between optimizer
    steps (a projection, a clamp) needs."""
    keep_durable: int = 3
    """Durable snapshots kept on disk, the newest by step (-1: all); older ones are deleted
    after each write, so a long run's disk use is bounded."""
    margin: int = 1
    """Restore a snapshot at least this many steps older than the fault."""
    ladder: list[str] = field(
        default_factory=lambda: ["retry", "skip_rows", "lower_lr", "fp32_reduction"]
    )
    """Remedies (registered names, stabilize/rollback/remedies.py). With ``classify``: the
    rungs that fit the fault's class, in this order (none fit: the whole ladder); without:
    one per successive rollback for the same monitor."""
    classify: bool = True
    """Re-run a faulty step to classify the fault (docs/rollback.md) and pick the remedy by
    its class: transient -> retry, data-linked -> skip_rows, deterministic -> the rest."""
    remedy: dict[str, Any] = field(default_factory=dict)
    """Each remedy's own settings, ``rollback.remedy.<name>.<knob>``: one section per
    registered remedy with a config dataclass (``Remedy.config``), built into it; a section
    left out takes that dataclass's defaults (``cfg.remedy.skip_data.batches``)."""
    max_rollbacks: int = 5
    """Rollbacks allowed in ``window`` steps; one more stops the run (exit code 3)."""
    window: int = 1000
    """The span, in steps, ``max_rollbacks`` counts over."""
    bundle: str = "fault"
    """Repro bundles (stability/bundle.py, replayed by ``stabilize-replay``): ``fault``
    on every verdict that rolls back (or would, with rollback off), ``always`` on warnings
    and scaler skips too, ``off``."""
    bundle_max_mb: float = 4096
    """A bundle whose state would be larger is written without it (-1: no bound)."""
    bundle_keep: int = 5
    """Bundles kept under run_dir/bundles, the newest by step (-1: all)."""

    def __post_init__(self):
        for k in ("snapshot_every", "keep", "max_rollbacks", "window"):
            check_positive(f"rollback.{k}", getattr(self, k), integer=True)
        check_range("rollback.durable_every", self.durable_every, 0, float("inf"))
        if self.keep_durable != -1:
            check_positive("rollback.keep_durable", self.keep_durable, integer=True)
        check_range("rollback.margin", self.margin, 0, float("inf"))
        for i, r in enumerate(self.ladder):
            check_choice(f"rollback.ladder[{i}]", r, REMEDIES)
        self.remedy = REMEDIES.build_sections(self.remedy, "rollback.remedy")
        check_choice("rollback.bundle", self.bundle, ("fault", "always", "off"))
        if self.bundle_max_mb != -1:
            check_positive("rollback.bundle_max_mb", self.bundle_max_mb)
        if self.bundle_keep != -1:
            check_positive("rollback.bundle_keep", self.bundle_keep, integer=True)


def _never(rung: str) -> str | None:
    return None


@dataclass
class Decision:
    action: str  # "rollback" | "abort"
    snapshot: Snapshot | None = None
    remedy: str | None = None
    reason: str = ""
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (rung, why it would not help)
    before: list[str] = field(default_factory=list)
    """The rung this fault's last rollback applied: it did not stop it."""


class RollbackPolicy:
    """Which snapshot, which remedy, or give up.

    A classified fault (``event.extra["class"]``) takes the ladder's rungs that fit its
    class (``Remedy.classes``): a transient or data-linked one the first of them every time
    (``retry``, ``skip_rows`` or ``skip_batch``: each occurrence is a new one), a
    deterministic one climbs them. An unclassified fault, or a class no rung fits, climbs
    the whole ladder. The diagnosed site orders the rungs: those whose ``Remedy.sites``
    name the fault's monitor go first (an overflowed reduction: fp32_reduction before
    lower_lr). Climbing: each
    rollback for the same monitor (and class) takes the next rung, passing over a rung that
    would change nothing on the current state (``Remedy.unchanged``, e.g. fp32_reduction
    when every norm already reduces in fp32: named in ``Decision.skipped``); past the last
    rung, or more than ``max_rollbacks`` rollbacks of any kind within ``window`` steps, it
    aborts.
    """

    def __init__(self, cfg: RollbackConfig):
        self.cfg = cfg
        self.history: list[dict[str, Any]] = []  # every rollback so far

    def decide(
        self, event: Event, ring: SnapshotRing, unchanged: Callable[[str], str | None] = _never
    ) -> Decision:
        """``unchanged(rung)``: why that rung would change nothing now (None: it would)."""
        recent = [h for h in self.history if h["fault_step"] > event.step - self.cfg.window]
        cls = event.extra.get("class")
        rungs = [r for r in self.cfg.ladder if cls in REMEDIES[r].classes] or self.cfg.ladder
        fitting = rungs
        # the diagnosed site first (a stable sort: the ladder's order within each group)
        rungs = sorted(rungs, key=lambda r: event.monitor not in REMEDIES[r].sites)
        same = [
            h for h in recent if h["monitor"] == event.monitor and h.get("class") == cls
        ]  # the ladder resets
        if cls in ("transient", "data") and fitting is not self.cfg.ladder:
            same = []  # each occurrence is a new fault: the first fitting rung again
        if len(recent) >= self.cfg.max_rollbacks:
            return Decision(
                "abort",
                reason=f"{len(recent)} rollbacks within "
                f"{self.cfg.window} steps (max {self.cfg.max_rollbacks})",
            )
        # the rungs this fault has used or passed over, in order: the next one is after them
        at = sum(1 + len(h.get("skipped", [])) for h in same)
        skipped = []
        while at < len(rungs) and (why := unchanged(rungs[at])) is not None:
            skipped.append((rungs[at], why))
            at += 1
        if at >= len(rungs):
            passed = "".join(f"; {r} skipped: {why}" for r, why in skipped)
            return Decision(
                "abort",
                reason=f"the remedy ladder {rungs} is exhausted "
                f"for {event.monitor!r}: the fault persists{passed}",
                skipped=skipped,
            )
        limit = event.step - self.cfg.margin
        # the replica check knows the last step every replica agreed on
        limit = min(limit, event.extra.get("restore_at_or_before", limit))
        snap = ring.newest_before(limit)
        if snap is None:
            return Decision(
                "abort",
                reason=f"no snapshot at or before step {limit} (have {ring.steps()})",
            )
        remedy = rungs[at]
        self.history.append(
            {
                "monitor": event.monitor,
                "fault_step": event.step,
                "restored_step": snap.step,
                "remedy": remedy,
                "message": event.message,
                "layer": event.layer,
                "class": cls,
                "skipped": [list(s) for s in skipped],
            }
        )
        before = [same[-1]["remedy"]] if same else []  # the rung that did not stop it
        return Decision("rollback", snap, remedy, skipped=skipped, before=before)

    def state_dict(self) -> dict:
        return {"history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = copy.deepcopy(state["history"])
