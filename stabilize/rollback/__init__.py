"""Rollback, trainer-agnostic: snapshots of the last good state (``snapshots``), the
policy that picks a snapshot and a remedy or gives up (``policy``), and the remedies
themselves (``remedies``, a registry keyed by the ladder's names), and the training state
they change (``state.TrainState``). The Lightning side is
stabilize/stability/controller.py.
"""

from stabilize.rollback import quant_remedies  # noqa: F401  (registers the quant rungs)
from stabilize.rollback.policy import Decision, RollbackConfig, RollbackPolicy
from stabilize.rollback.remedies import (
    REMEDIES,
    Remedy,
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
    prune_durable,
    save_durable,
    to_cpu,
)
from stabilize.rollback.state import TrainState

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
    "prune_durable",
    "reapply_remedies",
    "register_remedy",
    "save_durable",
    "to_cpu",
    "unregister_remedy",
]
