"""The no-fault and the point faults: each corrupts one step's loss or gradients.

A point fault fires at ``fault.step`` (``PointFault.fires``: its rank, once per run unless
persistent); the monitors must see it at that step and roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from stabilize.faults.base import Fault, PointFault, grad_targets, register_fault
from stabilize.faults.config import FaultConfig
from stabilize.validate import check_positive


@register_fault
class NoFault(Fault):
    """``fault=none``: every hook a no-op (the default of every run)."""

    kind = "none"


@register_fault
class NanLoss(PointFault):
    """The loss of the step turns NaN (so do all its gradients): the ``nonfinite`` monitor's
    case."""

    kind = "nan_loss"

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.fires(step) else loss


@dataclass
class InfGradConfig(FaultConfig):
    param: str | None = None
    """The parameter whose gradient turns inf (None: the first one)."""


@register_fault
class InfGrad(PointFault):
    """One element of one parameter's gradient (``fault.param``, default the first
    parameter) turns inf: a corrupted gradient the loss does not show. Element 0 of the
    whole gradient, before the reduce: under FSDP it reaches the rank whose shard holds it,
    whichever rank it was injected on."""

    kind = "inf_grad"
    config = InfGradConfig

    def arm(self, step: int, model: nn.Module) -> list[RemovableHandle]:
        if not self.fires(step):
            return []
        params = grad_targets(model)
        name = self.cfg.param or next(iter(params))
        if name not in params:
            raise ValueError(
                f"fault.param={name!r} is not a parameter; allowed: {list(params)[:8]} ..."
            )

        def poison(g):
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

        return [params[name].register_hook(poison)]


@dataclass
class GradSpikeFaultConfig(FaultConfig):
    factor: float = 100.0
    """Gradients multiplied by this."""

    def check(self) -> None:
        check_positive("fault.factor", self.factor)


@register_fault
class GradSpike(PointFault):
    """Every gradient of the step is multiplied by ``fault.factor``: the ``grad_spike``
    monitor's case (finite, just far too large)."""

    kind = "grad_spike"
    config = GradSpikeFaultConfig

    def arm(self, step: int, model: nn.Module) -> list[RemovableHandle]:
        if not self.fires(step):
            return []
        factor = self.cfg.factor
        return [p.register_hook(lambda g: g * factor) for p in grad_targets(model).values()]


@dataclass
class LossSpikeFaultConfig(FaultConfig):
    factor: float = 5.0
    """The step's loss is reported this many times higher."""

    def check(self) -> None:
        check_positive("fault.factor", self.factor)


@register_fault
class LossSpike(PointFault):
    """The step's loss is reported ``fault.factor`` times higher while its gradients stay the
    step's own (``loss + (factor - 1) * loss.detach()``): a spike in the loss alone, which the
    ``loss_spike`` monitor sees and the weights never do (the spike counterfactual's case of
    no damage, ``stabilize-replay --spike``)."""

    kind = "loss_spike"
    config = LossSpikeFaultConfig

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if not self.fires(step):
            return loss
        return loss + (self.cfg.factor - 1.0) * loss.detach()
