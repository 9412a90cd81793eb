"""The interface every fault kind implements, the firing rule of point faults, and the
registry of kinds by name (``fault.kind``, the Hydra ``fault=`` group, picks a class here).

A fault is keyed on the model's own step (``fault.step``) and optionally on one rank
(``fault.rank``). A *persistent* fault fires every time the model reaches its step, so it
recurs after a rollback rewinds the model (a deterministic bug); a *transient* one fires
once per run (a flipped bit, a bad host).

The training module calls, per micro-batch: ``begin(step, data_step)`` before the forward
(``data_step``: the micro-batch's data position), ``on_loss(step, loss)`` on the loss,
``arm(step, model)`` before the backward, and after it (through ``FaultInjector.disarm``)
removes what ``arm`` returned and calls ``after_backward(step, model)``: the gradients are
then all-reduced (DDP finishes its reduce inside the backward). ``attach(model)`` runs
once, before the monitors' hooks, for faults that live in the forward. The stability
callback snapshots ``snapshot_state()`` with every model snapshot, calls
``on_rollback(that state)`` when it restores one, and checkpoints ``state_dict()``.

A kind is registered once, by the class that implements it, with the dataclass of its
settings (``config``: the common ``FaultConfig`` keys plus the kind's knobs)::

    @dataclass
    class ScaleLossConfig(FaultConfig):
        scale: float = 1e6

    @register_fault
    class ScaleLoss(PointFault):
        kind = "scale_loss"
        config = ScaleLossConfig
        ...

and from then on ``fault.kind=scale_loss`` is accepted by ``fault_config`` (the allowed
values of its error message are the registered names, in registration order), with
``fault.scale``, and built by ``FaultInjector``. The built-in kinds register when
``stabilize.faults`` is imported.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stabilize.compat import fsdp_gathered_params
from stabilize.faults.config import FAULTS, FaultConfig
from stabilize.validate import ConfigError


def residual_blocks(model: nn.Module, layer: int | None = None) -> list[nn.Module]:
    """The model's residual blocks in order: our GPT's ``h``; any other model's as the
    probe finds them (``inspect_model``: the longest ModuleList of one class). ``layer``:
    the block a fault names, checked to be one of them (one line, before any hook)."""
    if isinstance(getattr(model, "h", None), nn.ModuleList):
        blocks = list(model.h)
    else:
        from stabilize.model.foreign import inspect_model

        blocks = [m for _, m in inspect_model(model).blocks]
    if layer is not None and not 0 <= layer < len(blocks):
        raise ConfigError(
            f"fault.layer={layer!r} is not allowed: the model has {len(blocks)} residual "
            f"blocks; allowed: 0 to {len(blocks) - 1}"
        )
    return blocks


def first_tensor(out):
    """A block's hidden states: the output, or its first item (transformers 4's tuples)."""
    return out[0] if isinstance(out, tuple) else out


def with_first(out, value):
    """``out`` with its hidden states replaced by ``value`` (a tuple stays a tuple)."""
    return (value, *out[1:]) if isinstance(out, tuple) else value


class Fault:
    """One fault kind: every hook a no-op, so a kind overrides only the ones it uses.

    Subclasses set ``kind`` (the ``fault.kind`` name) and ``config`` (the dataclass of its
    settings) and register with ``@register_fault``. ``validate`` checks the kind's
    settings against each other at config time (each knob alone: the config's ``check``).
    """

    kind: ClassVar[str] = ""
    config: ClassVar[type[FaultConfig]] = FaultConfig

    def __init__(self, cfg: FaultConfig, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.fired: set[int] = set()  # wall-clock firings (transient faults fire once)
        self.step = 0  # the model step whose forward runs now (set by begin())
        self.data_step = -1  # the data position of the micro-batch in flight (begin())
        self.disabled = False  # a transient fault that happened, then was rolled back

    # a kind whose ``persistent`` is fixed: (the value, why); any other value is refused
    fixed_persistent: ClassVar[tuple[bool, str] | None] = None

    @classmethod
    def validate(cls, cfg: FaultConfig) -> None:
        """Reject settings this kind cannot honour (called by ``FaultConfig``); a kind
        that overrides this calls it too."""
        fixed = cls.fixed_persistent
        if fixed is not None and cfg.kind == cls.kind and cfg.persistent != fixed[0]:
            want, why = str(fixed[0]).lower(), fixed[1]
            raise ValueError(f"fault.persistent={cfg.persistent} is not allowed with fault.kind="
                             f"{cls.kind}; allowed: {want} ({why})")  # fmt: skip

    def mine(self) -> bool:
        """Is this rank one the fault targets?"""
        return self.cfg.rank is None or self.cfg.rank == self.rank

    def fires(self, step: int) -> bool:
        """Does the point fault fire at this model step (on this rank)? Never, by default."""
        return False

    # ---- hooks --------------------------------------------------------------------------
    def begin(self, step: int, data_step: int = -1) -> None:
        """The model step the next training forward belongs to (validation reuses it), and
        the data position of its micro-batch (-1: unknown)."""
        self.step, self.data_step = step, data_step

    def bind_data(self, blocks) -> None:
        """At train start: the training blocks (``PackedBlocks``), for a fault on content."""

    def attach(self, model: nn.Module) -> None:
        """Once, before the monitors' hooks: install forward hooks (they run first)."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of ``step``'s micro-batch, possibly corrupted."""
        return loss

    def arm(self, step: int, model: nn.Module) -> list[RemovableHandle]:
        """Before the backward of ``step``: hooks on the gradients it corrupts, removed
        after that backward.

        Tensor hooks run when a gradient is produced, before DDP's all-reduce, so a fault
        on rank r reaches every rank through the reduce, as a real corrupted gradient would
        (corrupting after the reduce would only desynchronise rank r's replica).
        """
        return []

    def after_backward(self, step: int, model: nn.Module) -> None:
        """After the backward of ``step``'s micro-batch: the gradients are all-reduced, so a
        change made here stays on this rank (a silent corruption of one replica)."""

    # ---- rollback and checkpoints ---------------------------------------------------------
    @property
    def happened(self) -> bool:
        """Has the fault fired (or started)?"""
        return bool(self.fired)

    def trigger(self) -> str:
        """When it fires, in words: what a run that ends with it unfired never did (the
        end-of-run line, ``FaultInjector.outcome``)."""
        return f"at model step {self.cfg.step}{self.on_rank()}"

    def on_rank(self) -> str:
        """The words for its rank: " on rank R", or nothing for a fault on every rank."""
        return "" if self.cfg.rank is None else f" on rank {self.cfg.rank}"

    def snapshot_state(self) -> dict:
        """What a rollback rewinds: the fault's course (not the wall-clock firing history)."""
        return {}

    def restore(self, state: dict) -> None:
        """Rewind the course to a ``snapshot_state()``."""

    def stop(self) -> None:
        """A transient fault that happened is over: undo what its course still changes."""

    def on_rollback(self, snapshot_state: dict) -> None:
        """A rollback rewinds the model: a persistent fault rewinds with it (and recurs); a
        transient one that already happened is over; one that has not happened yet stays."""
        if self.cfg.persistent:
            self.restore(snapshot_state)
        elif self.happened:
            self.disabled = True
            self.stop()

    def state_dict(self) -> dict:
        """Everything, for checkpoints: a resumed run neither re-fires nor re-measures."""
        return {**self.snapshot_state(), "fired": sorted(self.fired), "disabled": self.disabled}

    def load_state_dict(self, state: dict) -> None:
        self.restore(state)
        self.fired = set(state["fired"])
        self.disabled = state["disabled"]


class PointFault(Fault):
    """A fault of one step: it fires when the model reaches ``fault.step`` (on its rank),
    once per run unless ``fault.persistent``."""

    def fires(self, step: int) -> bool:
        if self.disabled or step != self.cfg.step or not self.mine():
            return False
        if not self.cfg.persistent and step in self.fired:
            return False
        self.fired.add(step)
        return True


# ---- what a fault can touch, sharded or not -------------------------------------------------
def grad_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the backward computes gradients for, by parameter name: a gradient hook
    (``arm``) goes on these.

    Unsharded, the parameters themselves. Under FSDP2 (``fully_shard``) a parameter is a
    DTensor shard that is not in the autograd graph: the forward runs on a gathered copy
    (one ``nn.Parameter`` per parameter, kept across steps, its storage freed between uses),
    and a hook on the shard never fires (a fault armed there was a silent no-op).
    The gathered copies are returned instead; the reduce-scatter after the backward then
    carries a hooked change to whichever rank owns each element."""
    targets = dict(model.named_parameters())
    targets.update(fsdp_gathered_params(model))
    return targets


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's own elements: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---- the registry -------------------------------------------------------------------------
def register_fault(cls: type[Fault]) -> type[Fault]:
    """Register ``cls`` under ``cls.kind``, with ``cls.config`` (a class decorator; returns
    ``cls``)."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{cls.__qualname__}.kind={kind!r} is not allowed; must be a name")
    if not (isinstance(cls.config, type) and issubclass(cls.config, FaultConfig)):
        raise ValueError(
            f"{cls.__qualname__}.config={cls.config!r} is not allowed; must be FaultConfig "
            "or a dataclass subclass of it"
        )
    FAULTS.register(kind, cls, cls.config)
    return cls


def unregister_fault(kind: str) -> None:
    """Remove a kind (tests that register their own clean up with this)."""
    FAULTS.unregister(kind)


def fault_kinds() -> tuple[str, ...]:
    """The names ``fault.kind`` accepts, in registration order."""
    return tuple(FAULTS)


def fault_class(kind: str) -> type[Fault]:
    """The class registered under ``kind``; an unknown name fails with the allowed ones."""
    return FAULTS.lookup(kind)
