"""Value growth: one attention's output projection sees its input grow, and the model's
function does not change.

The 16-bit scenario's stream drift reaches only the norms, and in a pre-norm model a norm
bounds every matmul input it feeds, so no quantized GEMM sees it. This fault plants the
growth at a GEMM's input instead, where a format's scale has to follow it:

From ``fault.step`` on, block ``fault.layer``'s attention value vectors (the v third of
``attn.c_attn``'s output) are multiplied by f(t) and that block's ``attn.c_proj`` output is
divided by the same f(t) (its bias added back unscaled). Attention is linear in v, so
``c_proj``'s input is f(t) times the natural one, and in exact arithmetic the model's
function, its loss and every weight's gradient are unchanged: only the numerics see it.
``c_proj``'s grad-output shrinks by 1/f(t) at the same time.

f(t) = min(r_0 r_1 ... r_(t - step), target) with r_k = rate + accel k: geometric from
``fault.step`` at ``fault.rate`` per step (``fault.accel`` 0), or with a step ratio that
rises by ``fault.accel`` a step, held at ``fault.target``. Delayed scaling (an amax
history, margin 0) saturates while the growth per step exceeds 464 / 448 = 1.036 (E4M3's
largest value and the midpoint that still rounds to it): a steady rate saturates from its
first step or never, a rising one from the step its ratio passes that, which a forecast can
see coming; current scaling follows at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stabilize.faults.base import Fault, register_fault, residual_blocks
from stabilize.faults.config import FaultConfig
from stabilize.validate import ConfigError, check_positive, check_range


@dataclass
class ValueGrowthConfig(FaultConfig):
    layer: int = 0
    """The block whose attention output projection sees the growth."""
    rate: float = 1.1
    """The growth per step (> 1; >= 1 with ``accel``)."""
    accel: float = 0.0
    """How much the growth per step rises each step (0: a steady rate)."""
    target: float = 1e3
    """f's cap: the factor holds here (>= 1)."""

    def check(self) -> None:
        check_positive("fault.rate", self.rate)
        check_positive("fault.target", self.target)
        check_range("fault.accel", self.accel, 0.0, 1.0)
        if self.rate < 1 or (self.rate == 1 and self.accel == 0):
            raise ConfigError(f"fault.rate={self.rate!r} is not allowed; must be > 1 "
                              "(>= 1 with fault.accel > 0)")  # fmt: skip
        if self.target < 1:
            raise ConfigError(f"fault.target={self.target!r} is not allowed; must be >= 1")


def _attention(block: nn.Module, layer: int) -> tuple[nn.Module, nn.Module]:
    attn = getattr(block, "attn", None)
    c_attn, c_proj = getattr(attn, "c_attn", None), getattr(attn, "c_proj", None)
    if not isinstance(c_attn, nn.Module) or not isinstance(c_proj, nn.Module):
        raise ConfigError(
            f"fault.kind='value_growth' with fault.layer={layer} is not allowed: block "
            f"{layer} has no attn.c_attn and attn.c_proj; allowed: a GPT-style block"
        )
    return c_attn, c_proj


@register_fault
class ValueGrowth(Fault):
    """Multiplies block ``fault.layer``'s attention values by f(t) and divides its
    ``attn.c_proj`` output by f(t) (``fault.rate`` per step from ``fault.step``, capped at
    ``fault.target``). f is a function of the model step alone: a rollback rewinds it."""

    kind = "value_growth"
    config = ValueGrowthConfig

    def __init__(self, cfg: FaultConfig, rank: int = 0):
        super().__init__(cfg, rank)
        self.factor = 1.0  # f of the forward in flight

    def attach(self, model: nn.Module) -> None:
        block = residual_blocks(model, self.cfg.layer)[self.cfg.layer]
        c_attn, c_proj = _attention(block, self.cfg.layer)
        c_attn.register_forward_hook(self._grow_values)
        c_proj.register_forward_hook(self._shrink_output)

    def planned(self, step: int) -> float:
        """f at model step ``step`` (1 before ``fault.step``)."""
        c = self.cfg
        if step < c.step:
            return 1.0
        if c.accel == 0:
            return min(c.rate ** (step - c.step + 1), c.target)
        f = 1.0
        for k in range(step - c.step + 1):
            f *= c.rate + c.accel * k
            if f >= c.target:
                return c.target
        return f

    def _grow_values(self, module, args, out):
        active = not self.disabled and self.mine() and self.step >= self.cfg.step
        self.factor = self.planned(self.step) if active else 1.0
        if self.factor == 1.0:
            return out
        self.fired.add(self.cfg.step)
        c = out.shape[-1] // 3
        q, k, v = out.split(c, dim=-1)
        return torch.cat([q, k, v * self.factor], dim=-1)

    def _shrink_output(self, module, args, out):
        if self.factor == 1.0:
            return out
        bias = getattr(module, "bias", None)
        if bias is None:
            return out / self.factor
        return ((out - bias) / self.factor + bias).to(out.dtype)

    def trigger(self) -> str:
        return "from" + super().trigger().removeprefix("at")

    def stop(self) -> None:
        self.factor = 1.0
