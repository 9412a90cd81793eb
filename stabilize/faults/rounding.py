"""A silent precision fault: one site's output rounded with a bias
(docs/design-precision.md section 2).

``biased_round``: from ``fault.step`` on, the output of module ``fault.site`` (a norm, a
block, a projection: any module path of the model) is rounded **toward zero** to
``fault.bits`` mantissa bits (7: bf16's 8 significant bits; fewer: a coarser format), in
every forward, training and evaluation alike; the backward passes the gradient through as
a cast does. Truncation keeps the sign and exponent, so no
value can become non-finite or change sign: the run has a real, NaN-free gap with a known
culprit. Rounding toward zero shrinks each magnitude by half a unit in the last place on
average (2^-(bits+1) of it, ~0.2% at 7 bits): a bias that does not average out over steps,
unlike round-to-nearest's noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stabilize.faults.base import Fault, register_fault
from stabilize.faults.config import FaultConfig
from stabilize.model.fp32_sites import is_fp32
from stabilize.validate import ConfigError


def round_toward_zero(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` with all but ``bits`` of fp32's 23 mantissa bits cleared (toward zero), in
    ``x``'s dtype: exact there for bits <= 7 (bf16) or <= 10 (fp16)."""
    f = x.float()
    mask = ~((1 << (23 - bits)) - 1)  # an int32 mask: sign, exponent, the top ``bits``
    return (f.view(torch.int32) & mask).view(torch.float32).to(x.dtype)


@dataclass
class BiasedRoundConfig(FaultConfig):
    step: int = 1
    """The model step from which the site rounds (1: the whole run)."""
    persistent: bool = True
    """A precision choice stays: it recurs after a rollback (must stay true)."""
    site: str = "h.1.ln_1"
    """The module whose output is rounded (a module path of the model)."""
    bits: int = 7
    """Mantissa bits kept (0-22; 7: bf16's precision)."""

    def check(self) -> None:
        b = self.bits
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 22:
            raise ConfigError(f"fault.bits={b!r} is not allowed; allowed: an int in [0, 22]")


@register_fault
class BiasedRound(Fault):
    kind = "biased_round"
    config = BiasedRoundConfig
    fixed_persistent = (True, "a precision choice stays")

    def trigger(self) -> str:
        return f"from model step {self.cfg.step} on, at {self.cfg.site}{self.on_rank()}"

    def attach(self, model: nn.Module) -> None:
        names = dict(model.named_modules())
        if self.cfg.site not in names:
            near = [n for n in names if n.endswith(self.cfg.site.rsplit(".", 1)[-1])][:4]
            e_g = ", ".join(near) or next(iter(names), "")
            raise ConfigError(f"fault.site={self.cfg.site!r} is not allowed; not a module of "
                              f"the model (e.g. {e_g})")  # fmt: skip
        names[self.cfg.site].register_forward_hook(self._round)

    def _round(self, module, args, out):
        if self.disabled or self.step < self.cfg.step or not self.mine():
            return out
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or is_fp32(module):
            return out  # a site switched to fp32 (model.fp32_modules) rounds nothing
        if module.training:
            self.fired.add(self.step)
        # the value rounded, the gradient passed through as a cast's is (a bit mask has no
        # gradient: without this the site would cut the backward through it)
        return out + (round_toward_zero(out.detach(), self.cfg.bits) - out.detach())
