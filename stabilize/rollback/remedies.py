"""Remedies: the rungs of the rollback ladder, registered by the name the ladder uses.

A remedy applies itself to the training state right after a restore (the model, the LR
scale, the data position), and re-applies after a checkpoint load whatever of its effect
the checkpoint does not hold. The rollback controller only picks the rung and calls it.

Built in (PaLM skipped 200-500 batches around a spike; OPT-175B restarted with a lower LR;
the fp32 reduction is this project's own, docs/stability.md):
- ``retry``: restore and go on unchanged (a transient fault - a flipped bit, a bad host -
  does not recur; Megatron-LM re-runs a failing step to tell the two kinds apart);
- ``skip_data``: move the data position ``rollback.skip_batches`` past the restored one;
- ``lower_lr``: multiply the LR scale by ``rollback.lr_factor``;
- ``fp32_reduction``: switch every norm's reduction to fp32;
- ``z_loss``: switch PaLM's z-loss on (``rollback.z_loss`` x mean(log Z^2) added to the loss;
  Wortsman et al. 2023 found it prevents output-logit divergence), mid-run.
- ``skip_batch``: never train on the batches a data-linked fault was found in (their data
  positions join ``state.skipped``, kept in checkpoints and in the run dir's
  ``skipped_batches.json``, so a resume skips them too).

Each remedy says which fault classes it fits (``classes``; docs/stability.md): ``retry``
a transient fault, ``skip_data`` and ``skip_batch`` a data-linked one, the rest (the
numerics) a deterministic one.

A remedy from outside the package: subclass ``Remedy``, set ``name``, and
``register_remedy(MyRemedy())`` before the run's config is built (the ladder is checked
against the registry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from stabilize.norms import set_reduction_dtype
from stabilize.validate import check_choice

if TYPE_CHECKING:
    from stabilize.rollback.policy import RollbackConfig


class TrainState(Protocol):
    """What a remedy may change (``GPTLitModule`` has these)."""

    model: nn.Module
    lr_scale: float  # multiplies the schedule's LR; saved in checkpoints
    data_step: int  # the data position; saved in checkpoints
    skipped: set[int]  # data positions never trained on; saved in checkpoints
    fault_batches: list[int]  # the data positions the fault was found in (set before apply)


class Remedy:
    """One rung of the ladder. Subclasses set ``name`` and override what they change."""

    name: str = ""
    classes: tuple[str, ...] = ("deterministic",)
    """The fault classes this remedy fits (the policy picks among the ladder's fitting rungs)."""

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        """After the restore (model, optimizer and steps are the snapshot's): change the
        state; return what was done, for the rollback event's ``extra`` and message."""
        return {}

    def reapply(self, state: TrainState) -> None:
        """After a checkpoint load, for a run that had this remedy: re-impose what the
        checkpoint does not hold. Nothing for an effect kept in saved state (the LR scale,
        the data position)."""


class Retry(Remedy):
    name = "retry"
    classes = ("transient",)


class SkipData(Remedy):
    name = "skip_data"
    classes = ("data",)

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        state.data_step += cfg.skip_batches
        return {"skip_batches": cfg.skip_batches}


class LowerLR(Remedy):
    name = "lower_lr"

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        state.lr_scale *= cfg.lr_factor
        return {"lr_factor": cfg.lr_factor}


class FP32Reduction(Remedy):
    name = "fp32_reduction"

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        return {"norms_switched": set_reduction_dtype(state.model, "fp32")}

    def reapply(self, state: TrainState) -> None:
        set_reduction_dtype(state.model, "fp32")  # a module attribute, not in the state dict


class ZLoss(Remedy):
    """Sets the model's z-loss coefficient (``GPT.z_loss``, read by the loss every step) to
    ``rollback.z_loss``, or keeps a larger one already set. The coefficient is saved in
    checkpoints by the module (``stabilize.z_loss``), like the LR scale: no reapply."""

    name = "z_loss"

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        before = float(state.model.z_loss)
        state.model.z_loss = max(before, cfg.z_loss)
        return {"z_loss": state.model.z_loss, "z_loss_before": before}


class SkipBatch(Remedy):
    name = "skip_batch"
    classes = ("data",)

    def apply(self, state: TrainState, cfg: RollbackConfig) -> dict[str, Any]:
        state.skipped |= set(state.fault_batches)  # in place: the sampler holds this set
        return {"skipped_batches": sorted(state.fault_batches)}


REMEDIES: dict[str, Remedy] = {}


def register_remedy(remedy: Remedy) -> None:
    """Make ``remedy`` available to ladders under ``remedy.name``."""
    if not remedy.name or remedy.name in REMEDIES:
        raise ValueError(f"remedy {remedy.name!r} is already registered (or has no name)")
    REMEDIES[remedy.name] = remedy


def unregister_remedy(name: str) -> None:
    """Remove a registered remedy (tests registering their own clean up with this)."""
    del REMEDIES[name]


def get_remedy(name: str, key: str = "remedy") -> Remedy:
    check_choice(key, name, REMEDIES)
    return REMEDIES[name]


def reapply_remedies(state: TrainState, names: list[str]) -> None:
    """After a checkpoint load: each remedy the run has had, once, in first-use order."""
    for name in dict.fromkeys(names):
        get_remedy(name, "checkpoint remedies").reapply(state)


for _remedy in (Retry(), SkipData(), LowerLR(), FP32Reduction(), ZLoss()):
    register_remedy(_remedy)
register_remedy(SkipBatch())
