"""Faults that the re-run classification tells apart (docs/rollback.md).

- ``bitflip``: one bit of element 0 of ``fault.param`` flipped once, on ``fault.rank``
  only, after the backward (the all-reduce is done): in the parameter itself (``flip:
  param``, a silent corruption of one replica that only the replica check sees) or in its
  gradient (``flip: grad``: that rank alone applies a different update). Under FSDP, where
  a rank holds only its shard, element 0 of ``fault.rank``'s own shard: its memory. A replay of the
  step does not flip it again: *transient*.
- ``poisoned_batch``: the batch at data position ``fault.batch`` (the micro-batch number,
  ``data_step``) gives a NaN loss every time it is trained on, whatever the model step; on
  ``fault.rank`` or every rank. A replay of the step fails again, the next batch from the
  same state does not: *data-linked*.
- ``poisoned_item``: the training sequence of block ``fault.item`` makes its own row of the
  embedding output NaN wherever it is trained (any data position, any epoch, any row of the
  batch): the content is poisoned, as a real bad sequence is, so a replay of a subset of the
  batch's rows fails exactly when it holds that row (``stabilize-replay --data``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stabilize.faults.base import Fault, PointFault, local_part, register_fault
from stabilize.faults.config import FaultConfig
from stabilize.validate import ConfigError, check_choice, check_range


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of ``t``'s element 0 in place (through an integer view of its bytes)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        view = t.view(-1)[:1].view(ints)
        view ^= 1 << bit if bit < 8 * t.element_size() - 1 else -(1 << bit)


@dataclass
class BitFlipConfig(FaultConfig):
    param: str | None = "h.1.mlp.c_fc.weight"
    """The parameter whose bit flips (None: the first one)."""
    bit: int = 20
    """The bit flipped in element 0 of ``param`` (0: the lowest mantissa bit of an fp32;
    23-30: the exponent, a huge or tiny value; 31: the sign)."""
    flip: str = "param"
    """Flip the parameter itself (silent: only the replica check sees it) or its gradient
    (``grad``), after the all-reduce, on ``rank`` only."""

    def check(self) -> None:
        if isinstance(self.bit, bool) or not isinstance(self.bit, int) or not 0 <= self.bit < 32:
            raise ConfigError(f"fault.bit={self.bit!r} is not allowed; allowed: an int in [0, 32)")
        check_choice("fault.flip", self.flip, ("param", "grad"))


@register_fault
class BitFlip(PointFault):
    kind = "bitflip"
    config = BitFlipConfig
    fixed_persistent = (False, "a flipped bit happens once")

    def after_backward(self, step: int, model: nn.Module) -> None:
        if not self.fires(step):
            return
        params = dict(model.named_parameters())
        p = params[self.cfg.param or next(iter(params))]
        target = p if self.cfg.flip == "param" else p.grad
        if target is not None:  # under FSDP: element 0 of this rank's own shard
            flip_bit(local_part(target), self.cfg.bit)


@dataclass
class PoisonedBatchConfig(FaultConfig):
    step: int = 1
    """Unused: the batch, not the step, is poisoned."""
    batch: int | None = 10
    """The data position (micro-batch number, ``data_step``) whose batch gives a non-finite
    loss every time it is trained on."""

    def check(self) -> None:
        if self.batch is not None:
            check_range("fault.batch", self.batch, 0, float("inf"))


@register_fault
class PoisonedBatch(Fault):
    kind = "poisoned_batch"
    config = PoisonedBatchConfig

    @classmethod
    def validate(cls, cfg: FaultConfig) -> None:
        if cfg.kind == cls.kind and cfg.batch is None:
            raise ValueError(
                "fault.batch=None is not allowed with fault.kind=poisoned_batch; allowed: "
                "a data position (an int >= 0)"
            )

    def trigger(self) -> str:
        return f"when data position {self.cfg.batch} is trained{self.on_rank()}"

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.data_step != self.cfg.batch or not self.mine():
            return loss
        self.fired.add(step)
        return loss * float("nan")


@dataclass
class PoisonedItemConfig(FaultConfig):
    step: int = 1
    """Unused: the sequence, not the step, is poisoned."""
    item: int = 0
    """The training block (corpus item index) whose content is poisoned: its sequence gives
    NaN wherever it is trained."""

    def check(self) -> None:
        check_range("fault.item", self.item, 0, float("inf"))


@register_fault
class PoisonedItem(Fault):
    """Rows whose input ids equal block ``fault.item``'s get a NaN embedding, in training.

    The ids are bound once the training blocks are known (``bind_data``, at train start)
    and are part of the fault's course (``snapshot_state``), so a repro bundle's replay
    recognises the sequence without the corpus."""

    kind = "poisoned_item"
    config = PoisonedItemConfig

    def __init__(self, cfg: FaultConfig, rank: int = 0):
        super().__init__(cfg, rank)
        self.ids: torch.Tensor | None = None  # the poisoned block's input ids

    def bind_data(self, blocks) -> None:
        if not 0 <= self.cfg.item < len(blocks):
            raise ConfigError(
                f"fault.item={self.cfg.item} is not allowed; allowed: a training block in "
                f"[0, {len(blocks)})"
            )
        self.ids = blocks[self.cfg.item][0].clone()

    def trigger(self) -> str:
        return f"when training block {self.cfg.item} is drawn into a batch{self.on_rank()}"

    def attach(self, model: nn.Module) -> None:
        model.wte.register_forward_hook(self._poison)

    def _poison(self, module, args, out):
        idx = args[0]
        if self.ids is None or not module.training or not self.mine():  # bad data stays bad
            return out
        if idx.shape[-1] != self.ids.numel():
            return out
        rows = (idx == self.ids.to(idx.device)).all(dim=-1)  # [B]
        if not bool(rows.any()):
            return out
        self.fired.add(self.step)
        return torch.where(rows[:, None, None], out * float("nan"), out)

    def snapshot_state(self) -> dict:
        return {"poison_ids": self.ids.tolist() if self.ids is not None else None}

    def restore(self, state: dict) -> None:
        if state.get("poison_ids") is not None:
            self.ids = torch.tensor(state["poison_ids"], dtype=torch.int64)
