"""Rollback, trainer-agnostic: snapshots of the last good state (``snapshots``), the
policy that picks a snapshot and a remedy or gives up (``policy``), and the remedies
themselves (``remedies``, a registry keyed by the ladder's names). The Lightning side is
stabilize/lit/stability/controller.py.
"""

from stabilize.rollback.policy import Decision, RollbackConfig, RollbackPolicy
from stabilize.rollback.remedies import (
    REMEDIES,
    Remedy,
    TrainState,
    get_remedy,
    reapply_remedies,
    register_remedy,
    unregister_remedy,
)
from stabilize.rollback.snapshots import (
    DurableWriter,
    Snapshot,
    SnapshotRing,
    load_durable,
    save_durable,
    to_cpu,
)

__all__ = [
    "REMEDIES",
    "Decision",
    "DurableWriter",
    "Remedy",
    "RollbackConfig",
    "RollbackPolicy",
    "Snapshot",
    "SnapshotRing",
    "TrainState",
    "get_remedy",
    "load_durable",
    "reapply_remedies",
    "register_remedy",
    "save_durable",
    "to_cpu",
    "unregister_remedy",
]
