"""Remedies: the rungs of the rollback ladder, registered by the name the ladder uses.

A remedy applies itself to the training state right after a restore (the model, the LR
scale, the data position), and re-applies after a checkpoint load whatever of its effect
the checkpoint does not hold. The rollback controller only picks the rung and calls it.

Built in (PaLM skipped 200-500 batches around a spike; OPT-175B restarted with a lower LR;
the fp32 reduction is this project's own, docs/rollback.md):
- ``retry``: restore and go on unchanged (a transient fault - a flipped bit, a bad host -
  does not recur; Megatron-LM re-runs a failing step to tell the two kinds apart);
- ``skip_data``: move the data position ``rollback.remedy.skip_data.batches`` past the
  restored one;
- ``lower_lr``: multiply the LR scale by ``rollback.remedy.lower_lr.factor``;
- ``fp32_reduction``: switch every norm's reduction to fp32;
- ``fp32_sites``: switch to fp32 only the norms whose reduction overflowed in the failing
  step (kept in checkpoints; not in the default ladder);
- ``z_loss``: switch PaLM's z-loss on (``rollback.remedy.z_loss.weight`` x mean(log Z^2)
  added to the loss;
  Wortsman et al. 2023 found it prevents output-logit divergence), mid-run.
- ``skip_batch``: never train on the batches a data-linked fault was found in (their data
  positions join ``state.skipped``, kept in checkpoints and in the run dir's
  ``skipped_batches.json``, so a resume skips them too).
- ``skip_rows``: never train on the sequences of those batches whose own loss was
  non-finite (``state.skipped_items``, ``skipped_items.json``); the rest of each batch
  trains. In the default ladder, second (``[retry, skip_rows, lower_lr, fp32_reduction]``).

Each remedy says which fault classes it fits (``classes``; docs/rollback.md): ``retry``
a transient fault, ``skip_data`` and ``skip_batch`` a data-linked one, the rest (the
numerics) a deterministic one.

Each remedy's settings are its own config dataclass (``Remedy.config``), read from
``rollback.remedy.<name>`` (``RollbackConfig.remedy``; the composed config holds one section
per remedy with settings, its dataclass's defaults: stabilize/config_store.py); a remedy
without settings has none. ``apply`` and ``reapply`` receive that config.

A remedy from outside the package: subclass ``Remedy``, set ``name`` (and ``config``, a
dataclass of its settings), and ``register_remedy(MyRemedy())`` before the run's config is
composed (the ladder and ``rollback.remedy`` are checked against the registry; its settings
need no ``+``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from stabilize.norms import Norm, set_reduction_dtype
from stabilize.registry import Registry
from stabilize.rollback.state import TrainState
from stabilize.validate import check_positive, check_range


class Remedy:
    """One rung of the ladder. Subclasses set ``name`` (and ``config``) and override what
    they change."""

    name: str = ""
    classes: tuple[str, ...] = ("deterministic",)
    """The fault classes this remedy fits (the policy picks among the ladder's fitting rungs)."""
    config: ClassVar[type | None] = None
    """The dataclass of its settings (``rollback.remedy.<name>``); None: it has none."""
    sites: tuple[str, ...] = ()
    """Monitors whose verdict this rung answers first: for such a fault the policy moves
    it ahead of the ladder's other fitting rungs (fp32_reduction for an overflowed
    reduction: a lower LR cannot stop a reduction from overflowing)."""

    def unchanged(self, state: TrainState, cfg: Any) -> str | None:
        """Why applying it now would change nothing (the policy then skips it and says so);
        None: it would change something."""
        return None

    def apply(self, state: TrainState, cfg: Any) -> dict[str, Any]:
        """After the restore (model, optimizer and steps are the snapshot's): change the
        state as ``cfg`` (this remedy's config, None without one) says; return what was
        done, for the rollback event's ``extra`` and message."""
        return {}

    def reapply(self, state: TrainState, cfg: Any, times: int) -> None:
        """After a checkpoint load, for a run that had this remedy ``times`` times: re-impose
        what the checkpoint does not hold (an effect that compounds per application is
        restored by compounding it ``times`` times). Nothing for an effect kept in saved
        state (the LR scale, the data position)."""

    kept_because: str = "its change cannot cause the fault it was tried on"
    """Said when a later rung answers the same fault and this one is not undone."""

    def undo(self, state: TrainState, cfg: Any) -> dict[str, Any] | None:
        """Take back one application, when a later rung answers the fault it did not stop:
        what was undone, or None (kept, ``kept_because``)."""
        return None


class Retry(Remedy):
    name = "retry"
    classes = ("transient",)


@dataclass
class SkipDataConfig:
    """``rollback.remedy.skip_data``."""

    batches: int = 20
    """Batches (micro-batches) skipped past the restored position."""

    def __post_init__(self):
        check_positive("rollback.remedy.skip_data.batches", self.batches, integer=True)


class SkipData(Remedy):
    kept_because = "the batches it passed over are behind the run (never trained on)"
    name = "skip_data"
    classes = ("data",)
    config = SkipDataConfig

    def apply(self, state: TrainState, cfg: SkipDataConfig) -> dict[str, Any]:
        state.data_step += cfg.batches
        return {"skip_batches": cfg.batches}


@dataclass
class LowerLRConfig:
    """``rollback.remedy.lower_lr``."""

    factor: float = 0.5
    """The schedule's LR is multiplied by this (again at each application)."""
    recover_after: int = 50
    """After this many model steps with no rollback, the LR warms back to its schedule
    (0: the lowered LR stays for the rest of the run, as OPT-175B's restarts kept it)."""
    warmup: int = 20
    """... linearly, over this many steps."""

    def __post_init__(self):
        check_range("rollback.remedy.lower_lr.factor", self.factor, 1e-6, 1.0)
        check_range("rollback.remedy.lower_lr.recover_after", self.recover_after, 0, 10**9)
        check_positive("rollback.remedy.lower_lr.warmup", self.warmup, integer=True)


def lr_scale_at(scale: float, since: int | None, step: int, cfg: LowerLRConfig | None) -> float:
    """The LR scale in force at model ``step``: ``scale`` (the product of the lower_lr
    factors) until ``cfg.recover_after`` healthy steps have passed since ``since`` (the
    model step of the last rollback that left the LR lowered), then a linear ramp back to
    1 over ``cfg.warmup`` steps."""
    if scale >= 1.0 or since is None or cfg is None or cfg.recover_after == 0:
        return scale
    t = step - since - cfg.recover_after
    if t <= 0:
        return scale
    return 1.0 if t >= cfg.warmup else scale + (1.0 - scale) * t / cfg.warmup


class LowerLR(Remedy):
    """The LR scale is saved in checkpoints by the module: no reapply. A lowered LR that
    did not stop the fault costs every later step: a later rung takes it back."""

    name = "lower_lr"
    config = LowerLRConfig

    def apply(self, state: TrainState, cfg: LowerLRConfig) -> dict[str, Any]:
        state.lr_scale *= cfg.factor
        return {"lr_factor": cfg.factor, "lr_recover_after": cfg.recover_after}

    def undo(self, state: TrainState, cfg: LowerLRConfig) -> dict[str, Any] | None:
        state.lr_scale = min(1.0, state.lr_scale / cfg.factor)
        return {"lr_scale": state.lr_scale}


class FP32Reduction(Remedy):
    kept_because = "a reduction in fp32 cannot overflow where fp16's did: kept"
    name = "fp32_reduction"
    sites = ("overflow",)

    def unchanged(self, state: TrainState, cfg: None) -> str | None:
        dtypes = {m.reduction_dtype for m in state.model.modules() if isinstance(m, Norm)}
        return "every norm already reduces in fp32" if dtypes <= {"fp32"} else None

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        return {"norms_switched": set_reduction_dtype(state.model, "fp32")}

    def reapply(self, state: TrainState, cfg: None, times: int) -> None:
        set_reduction_dtype(state.model, "fp32")  # a module attribute, not in the state dict


class FP32Sites(Remedy):
    """Switches to fp32 only the norms whose reduction overflowed in the failing step (the
    verdict's layers, ``state.fault_sites``): the ladder changes what failed and nothing
    else (``stabilize-replay --bisect`` finds the same set from a bundle). The sites are
    kept in the train state (checkpoints), so a resume switches them again."""

    name = "fp32_sites"
    sites = ("overflow",)

    def unchanged(self, state: TrainState, cfg: None) -> str | None:
        norms = {n: m for n, m in state.model.named_modules() if isinstance(m, Norm)}
        todo = [s for s in state.fault_sites if s in norms and norms[s].reduction_dtype != "fp32"]
        return None if todo else "no overflowed norm left to switch to fp32"

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        norms = {n: m for n, m in state.model.named_modules() if isinstance(m, Norm)}
        done = [s for s in state.fault_sites if s in norms and norms[s].reduction_dtype != "fp32"]
        for s in done:
            norms[s].reduction_dtype = "fp32"
        state.fp32_sites = sorted({*state.fp32_sites, *done})
        return {"norms_switched": len(done), "sites": done}

    def reapply(self, state: TrainState, cfg: None, times: int) -> None:
        norms = dict(state.model.named_modules())
        for s in state.fp32_sites:  # module attributes, not in the state dict
            norms[s].reduction_dtype = "fp32"


@dataclass
class ZLossConfig:
    """``rollback.remedy.z_loss``."""

    weight: float = 1e-4
    """The z-loss coefficient it switches on (PaLM used 1e-4)."""

    def __post_init__(self):
        check_range("rollback.remedy.z_loss.weight", self.weight, 1e-12, float("inf"))


class ZLoss(Remedy):
    """Sets the model's z-loss coefficient (``GPT.z_loss``, read by the loss every step) to
    ``rollback.remedy.z_loss.weight``, or keeps a larger one already set. The coefficient is
    saved in checkpoints by the module (``stabilize.z_loss``), like the LR scale: no reapply."""

    name = "z_loss"
    config = ZLossConfig

    def unchanged(self, state: TrainState, cfg: ZLossConfig) -> str | None:
        if not hasattr(state.model, "z_loss"):
            return f"{type(state.model).__name__}'s loss has no z-loss term to switch on"
        return None

    def apply(self, state: TrainState, cfg: ZLossConfig) -> dict[str, Any]:
        before = float(state.model.z_loss)
        state.model.z_loss = max(before, cfg.weight)
        return {"z_loss": state.model.z_loss, "z_loss_before": before}


class SkipBatch(Remedy):
    name = "skip_batch"
    classes = ("data",)

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        state.skipped |= set(state.fault_batches)  # in place: the sampler holds this set
        return {"skipped_batches": sorted(state.fault_batches)}


class SkipRows(Remedy):
    """Never train on the sequences of a data-linked fault whose own loss was non-finite
    (``state.fault_items``, found by one forward per bad micro-batch): they join
    ``state.skipped_items`` (the sampler replaces each by the next block, so the rest of
    the batch still trains; kept in checkpoints and ``skipped_items.json``). Where no row
    is non-finite alone (a fault in the backward, or in the loss as a whole), the batches
    are skipped as ``skip_batch`` does."""

    name = "skip_rows"
    classes = ("data",)

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        if not state.fault_items:
            state.skipped |= set(state.fault_batches)
            return {"skipped_batches": sorted(state.fault_batches), "rows": "none alone"}
        new = {int(it["index"]): it["hash"] for it in state.fault_items}
        state.skipped_items.update(new)  # in place: the sampler holds this dict
        return {"skipped_items": [f"{i}:{h}" for i, h in sorted(new.items())]}


REMEDIES: Registry[Remedy] = Registry("remedy")
"""name -> the registered ``Remedy`` (its config: ``REMEDIES.config(name)``)."""


def register_remedy(remedy: Remedy) -> None:
    """Make ``remedy`` available to ladders under ``remedy.name``, its settings under
    ``rollback.remedy.<name>`` (``remedy.config``)."""
    REMEDIES.register(remedy.name, remedy, remedy.config)


def unregister_remedy(name: str) -> None:
    """Remove a registered remedy (tests registering their own clean up with this)."""
    REMEDIES.unregister(name)


def get_remedy(name: str, key: str = "remedy") -> Remedy:
    return REMEDIES.lookup(name, key)


def reapply_remedies(state: TrainState, names: list[str], cfgs: dict[str, Any]) -> None:
    """After a checkpoint load: each remedy the run has had (``names``: one entry per
    application), once, in first-use order, told how many times it was applied; ``cfgs``:
    the run's ``rollback.remedy`` sections."""
    for name, times in Counter(names).items():  # a Counter keeps first-seen order
        get_remedy(name, "checkpoint remedies").reapply(state, cfgs.get(name), times)


for _remedy in (Retry(), SkipData(), LowerLR(), FP32Reduction(), ZLoss()):
    register_remedy(_remedy)
register_remedy(SkipBatch())
register_remedy(SkipRows())
register_remedy(FP32Sites())
