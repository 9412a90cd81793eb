"""Faults that the re-run classification tells apart (issue 15, docs/stability.md).

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
"""

from __future__ import annotations

import torch
from torch import nn

from stabilize.faults.base import Fault, PointFault, local_part, register_fault
from stabilize.faults.config import FaultConfig


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of ``t``'s element 0 in place (through an integer view of its bytes)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        view = t.view(-1)[:1].view(ints)
        view ^= 1 << bit if bit < 8 * t.element_size() - 1 else -(1 << bit)


@register_fault
class BitFlip(PointFault):
    kind = "bitflip"

    @classmethod
    def validate(cls, cfg: FaultConfig) -> None:
        if cfg.kind == cls.kind and cfg.persistent:
            raise ValueError(
                "fault.persistent=True is not allowed with fault.kind=bitflip; allowed: "
                "false (a flipped bit happens once)"
            )

    def after_backward(self, step: int, model: nn.Module) -> None:
        if not self.fires(step):
            return
        params = dict(model.named_parameters())
        p = params[self.cfg.param or next(iter(params))]
        target = p if self.cfg.flip == "param" else p.grad
        if target is not None:  # under FSDP: element 0 of this rank's own shard
            flip_bit(local_part(target), self.cfg.bit)


@register_fault
class PoisonedBatch(Fault):
    kind = "poisoned_batch"

    @classmethod
    def validate(cls, cfg: FaultConfig) -> None:
        if cfg.kind == cls.kind and cfg.batch is None:
            raise ValueError(
                "fault.batch=None is not allowed with fault.kind=poisoned_batch; allowed: "
                "a data position (an int >= 0)"
            )

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.data_step != self.cfg.batch or not self.mine():
            return loss
        self.fired.add(step)
        return loss * float("nan")
