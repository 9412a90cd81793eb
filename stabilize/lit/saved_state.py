"""What a checkpoint holds of the run besides Lightning's own state (``checkpoint["stabilize"]``):
the model's and the data's positions, what the remedies changed, the batches a data-linked
fault is never trained on again, and the config the run was started with."""

from __future__ import annotations

from typing import Any

from stabilize.rollback import reapply_remedies


def saved_state(module) -> dict[str, Any]:
    """``module``: a GPTLitModule."""
    return {
        "model_step": module.model_step,
        "data_step": module.data_step,
        "lr_scale": module.lr_scale,
        "lr_since": module.lr_since,
        "remedies": list(module.remedies),
        "z_loss": float(module.model.z_loss),  # the z_loss remedy may have switched it on
        "skipped": sorted(module.skipped),
        "config": module.cfg.to_dict(),
    }


def restore_state(module, state: dict[str, Any]) -> None:
    module.model_step = state["model_step"]
    module.data_step = state["data_step"]
    module.lr_scale = state.get("lr_scale", 1.0)
    module.lr_since = state.get("lr_since")
    module.remedies = list(state.get("remedies", []))
    module.model.z_loss = state.get("z_loss", module.cfg.model.z_loss)
    module.skipped |= set(state.get("skipped", []))
    module.data_step = module.next_position(module.data_step)
    # what the state dict does not hold (fp32_reduction's norm switch): re-applied
    reapply_remedies(module, module.remedies, module.cfg.rollback.remedy)
