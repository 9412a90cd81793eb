"""Activation drift: a residual stream drifting towards ~1e4, on a planned path.

From ``fault.step`` on, block ``fault.layer``'s residual update (output - input) is
multiplied by a factor f, in every channel or only in the first ``fault.channels`` (an
outlier feature: a few channels carry the growth, as the massive activations of large LMs
do; then one |x_i| passes 256 while the rest of the row stays small). The stream's |x| max
after that block follows a geometric path from the value measured at ``step`` either to
``target`` at ``target_step``, or through ``cross`` (default 256) between ``cross_step - 1``
and ``cross_step``; the rate is derived from that step, never hard-coded. Past the target
it holds (or keeps growing at the same rate).

The factor is solved inside each forward (in closed form, one reduction), so the |x| max
is on its planned path (to ~1e-6) whatever the optimizer does in reaction: the step where a
line is crossed is exact and deterministic, which tests and scenarios rely on. This costs
two host reads per forward of the faulty block; only drift runs pay it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from stabilize.faults.base import Fault, register_fault, residual_blocks
from stabilize.faults.config import FaultConfig
from stabilize.validate import check_positive


@dataclass
class ActivationDriftConfig(FaultConfig):
    layer: int = 0
    """The block whose output drifts."""
    target: float = 1e4
    """The |x| max to reach ..."""
    target_step: int | None = 150
    """... at this step, or (None) at the rate ``cross_step`` sets."""
    cross_step: int | None = None
    """|x| max first passes ``cross`` at this step (the rate follows)."""
    cross: float = 256.0
    """The line ``cross_step`` refers to (256: the first fp16 square that is inf)."""
    channels: int | None = None
    """Drift only the first k channels, an outlier feature (None: all). ``stream_drift``:
    must stay None, the whole stream scales (``activation_drift`` for an outlier)."""
    keep_growing: bool = False
    """Past the target: hold (False) or keep the rate (True)."""

    def check(self) -> None:
        check_positive("fault.target", self.target)
        check_positive("fault.cross", self.cross)
        if self.channels is not None:
            check_positive("fault.channels", self.channels, integer=True)


@register_fault
class ActivationDrift(Fault):
    """Pins block ``fault.layer``'s |x| max to a geometric path from ``fault.step`` on
    (``fault.target`` / ``target_step``, or ``cross`` / ``cross_step``; ``channels``,
    ``keep_growing``). Its course (``drift_factor``, ``drift_start``) rewinds on rollback."""

    kind = "activation_drift"
    config = ActivationDriftConfig

    def __init__(self, cfg: FaultConfig, rank: int = 0):
        super().__init__(cfg, rank)
        self.drift_factor = 1.0  # the last solved factor (the next solve's first guess)
        self.drift_start: float | None = None  # |x| max measured at the start step

    @classmethod
    def validate(cls, cfg: FaultConfig) -> None:
        if (cfg.target_step is None) == (cfg.cross_step is None):
            raise ValueError(
                f"fault.target_step={cfg.target_step} with fault.cross_step={cfg.cross_step} "
                f"is not allowed; allowed: exactly one of them set (the other null)"
            )
        for key in ("target_step", "cross_step"):
            v = getattr(cfg, key)
            if v is not None and v <= cfg.step:
                raise ValueError(f"fault.{key}={v} is not allowed; must be > fault.step={cfg.step}")
        if cfg.cross_step is not None and cfg.cross >= cfg.target:
            raise ValueError(
                f"fault.cross={cfg.cross} is not allowed with cross_step; must be < "
                f"fault.target={cfg.target}"
            )

    def attach(self, model: nn.Module) -> None:
        block = residual_blocks(model, self.cfg.layer)[self.cfg.layer]
        block.register_forward_hook(self._drift_hook)

    def _drift_hook(self, module, args, out):
        c = self.cfg
        if self.disabled or not self.mine() or self.step < c.step:
            return out
        x = args[0]
        k = c.channels or out.shape[-1]
        with torch.no_grad():
            u = (out - x)[..., :k].float()  # the residual update, drifting channels
            x0 = x[..., :k].float()
            if self.drift_start is None:  # the first drift step: the natural level
                self.drift_start = float(out[..., :k].abs().max())
            f = self._solve(x0, u, self.planned(self.step))
        self.drift_factor = f
        if k == out.shape[-1]:
            return x + (out - x) * f
        return torch.cat([x[..., :k] + (out[..., :k] - x[..., :k]) * f, out[..., k:]], dim=-1)

    @staticmethod
    def _solve(x: torch.Tensor, u: torch.Tensor, target: float) -> float:
        """The f >= 0 with max|x + f u| = target, in closed form.

        g(f) = max_k |x_k + f u_k| is convex with g(0) = max|x|; when that is below the
        target, g first reaches it where the first element does: f = min over k of the
        positive root of |x_k + f u_k| = target, (target - x_k sgn(u_k)) / |u_k|. When the
        stream is already at or above the target without this block's update, it is left
        as it is (f = 1).
        """
        x, u = x.double().reshape(-1), u.double().reshape(-1)
        if float(x.abs().max()) >= target:
            return 1.0
        moving = u != 0
        roots = (target - x[moving] * u[moving].sign()) / u[moving].abs()
        return float(roots.min()) if roots.numel() else 1.0

    def rate(self) -> float:
        """log-|x|-max growth per step, derived from where the path must be when."""
        c = self.cfg
        if c.cross_step is not None:
            # cross the line half-way between cross_step - 1 and cross_step (in log): the
            # last step before is below it, cross_step is above, whatever the rounding
            goal, span, key = c.cross, c.cross_step - 0.5 - c.step, "cross"
        else:
            goal, span, key = c.target, c.target_step - c.step, "target"
        if self.drift_start >= goal:
            raise ValueError(
                f"fault.{key}={goal:g} is not allowed: block {c.layer}'s |x| max is already "
                f"{self.drift_start:.4g} at fault.step={c.step}; allowed: above that level "
                f"(or an earlier fault.step)"
            )
        return math.log(goal / self.drift_start) / span

    def planned(self, step: int) -> float:
        """The |x| max the drift pins block ``layer``'s output to at ``step``."""
        c = self.cfg
        k = step - c.step
        value = self.drift_start * math.exp(self.rate() * k)
        return value if c.keep_growing else min(value, max(c.target, self.drift_start))

    # ---- rollback and checkpoints ---------------------------------------------------------
    @property
    def happened(self) -> bool:
        """Fired or started: the drift has started once its natural level is measured."""
        return super().happened or self.drift_start is not None

    def trigger(self) -> str:
        return "from" + super().trigger().removeprefix("at")

    def snapshot_state(self) -> dict:
        return {"drift_factor": self.drift_factor, "drift_start": self.drift_start}

    def restore(self, state: dict) -> None:
        # .get: a checkpoint of another kind's run carries no course (or the neutral one)
        self.drift_factor = state.get("drift_factor", 1.0)
        self.drift_start = state.get("drift_start")

    def stop(self) -> None:
        self.drift_factor = 1.0
