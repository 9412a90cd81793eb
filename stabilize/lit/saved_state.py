"""What a checkpoint holds of the run besides Lightning's own state (``checkpoint["stabilize"]``):
the module's ``TrainState`` (the model's and the data's positions, what the remedies changed,
the batches a data-linked fault is never trained on again) and the config the run was
started with."""

from __future__ import annotations

from typing import Any

from stabilize.rollback import reapply_remedies


def saved_state(module) -> dict[str, Any]:
    """``module``: a GPTLitModule."""
    return {**module.train_state.state_dict(), "config": module.cfg.to_dict()}


def restore_state(module, state: dict[str, Any]) -> None:
    ts = module.train_state
    ts.load_state_dict(state, z_loss=module.cfg.model.z_loss)
    # what the state dict does not hold (fp32_reduction's norm switch): re-applied
    reapply_remedies(ts, ts.remedies, module.cfg.rollback.remedy)
