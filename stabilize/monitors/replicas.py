"""Replica check during training: every rank's parameters must be bit-identical.

Every ``monitor.replicas.every`` steps the step gather carries each rank's exact parameter
fingerprint (the raw bits summed as integers, stabilize/stability/gather.py: any one
flipped bit changes it). A rank whose fingerprint differs from the majority's is named and
the run rolls back to a snapshot no newer than the last check that agreed (``extra``
``restore_at_or_before``): the snapshots after it may hold the corrupted replica. With two
ranks there is no majority: the rank that differs from rank 0 is named (rank 0 is the
reference DDP broadcasts from at start; a flip on rank 0 itself also names rank 1).
A divergence is *transient* by nature (every rank ran the same step on the same reduced
gradients): its remedy is ``retry``, and the named rank's count grows.
Megatron-LM checks weight hashes across replicas too, at the end of a job.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from stabilize.monitors.events import ROLLBACK, Event, StepStats
from stabilize.validate import check_positive


@dataclass
class ReplicasConfig:
    """``monitor.replicas``: the replica check (multi-process runs only)."""

    enabled: bool = True
    """Compare every rank's parameter fingerprint (ignored in a 1-process run)."""
    every: int = 10
    """N: every N optimizer steps (a bitflip is named within N steps)."""

    def __post_init__(self):
        check_positive("monitor.replicas.every", self.every, integer=True)


def divergent(fps: tuple[int, ...]) -> list[int]:
    """The ranks whose fingerprint is not the majority's (on a tie: not rank 0's)."""
    counts = Counter(fps)
    top = max(counts.values())
    ref = fps[0] if counts[fps[0]] == top else counts.most_common(1)[0][0]
    return [r for r, f in enumerate(fps) if f != ref]


class ReplicasMonitor:
    name = "replicas"
    needs = ("replicas",)

    @classmethod
    def from_config(cls, name: str, c: ReplicasConfig) -> ReplicasMonitor:
        return cls()

    def __init__(self):
        self.verified = 0  # the newest model step whose weights every rank held alike

    def update(self, stats: StepStats) -> list[Event]:
        fps = stats.replicas
        if len(fps) < 2:
            return []
        bad = divergent(fps)
        if not bad:
            # measured before this step's update: the weights after step - 1
            self.verified = stats.step - 1
            return []
        return [
            Event(
                ROLLBACK,
                "replicas",
                stats.step,
                f"rank(s) {bad} hold different parameters (fingerprints {list(fps)}); the "
                f"last check that agreed: after step {self.verified}",
                extra={
                    "ranks": bad,
                    "class": "transient",
                    "restore_at_or_before": self.verified,
                    "fingerprints": [str(f) for f in fps],
                },
            )
        ]

    def state_dict(self) -> dict:
        return {"verified": self.verified}

    def load_state_dict(self, state: dict) -> None:
        self.verified = state["verified"]
