"""Step-targeted, rank-targeted fault injection, for tests and failure scenarios.

Faults are keyed on the model's own step. A *persistent* fault fires every time the model
reaches its step, so it recurs after a rollback rewinds the model (a deterministic bug); a
*transient* one fires once per run (a flipped bit, a bad host).

Activation drift models a residual stream drifting towards ~1e4: from ``step`` on, block
``layer``'s residual update (output - input) is multiplied by a factor f, in every channel
or only in the first ``channels`` (an outlier feature: a few channels carry the growth, as
the massive activations of large LMs do; then one |x_i| passes 256 while the rest of the
row stays small). The stream's |x| max after that block follows a geometric path from the
value measured at ``step`` either to ``target`` at ``target_step``, or through ``cross``
(default 256) between ``cross_step - 1`` and ``cross_step``; the rate is derived from that
step, never hard-coded. Past the target it holds (or keeps growing at the same rate).

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

from stabilize.validate import check_choice, check_positive

FAULT_KINDS = ("none", "nan_loss", "inf_grad", "grad_spike", "activation_drift")


@dataclass
class FaultConfig:
    kind: str = "none"
    step: int = 100  # the model step it fires at (drift: where it starts)
    rank: int | None = None  # None: every rank
    persistent: bool = False
    factor: float = 100.0  # grad_spike: gradients multiplied by this
    param: str | None = None  # inf_grad: parameter name (default: the first one)
    layer: int = 0  # activation_drift: the block
    target: float = 1e4  # activation_drift: |x| max to reach ...
    target_step: int | None = 150  # ... at this step, or (null) at the rate cross_step sets
    cross_step: int | None = None  # |x| max first passes `cross` at this step
    cross: float = 256.0  # the line cross_step refers to (256: the first fp16 square inf)
    channels: int | None = None  # drift only the first k channels (null: all)
    keep_growing: bool = False  # after the target: hold (False) or keep the rate (True)

    def __post_init__(self):
        check_choice("fault.kind", self.kind, FAULT_KINDS)
        check_positive("fault.step", self.step, integer=True)
        check_positive("fault.factor", self.factor)
        check_positive("fault.target", self.target)
        check_positive("fault.cross", self.cross)
        if self.channels is not None:
            check_positive("fault.channels", self.channels, integer=True)
        if self.kind != "activation_drift":
            return
        if (self.target_step is None) == (self.cross_step is None):
            raise ValueError(
                f"fault.target_step={self.target_step} with fault.cross_step={self.cross_step} "
                f"is not allowed; allowed: exactly one of them set (the other null)"
            )
        for key in ("target_step", "cross_step"):
            v = getattr(self, key)
            if v is not None and v <= self.step:
                raise ValueError(
                    f"fault.{key}={v} is not allowed; must be > fault.step={self.step}"
                )
        if self.cross_step is not None and self.cross >= self.target:
            raise ValueError(
                f"fault.cross={self.cross} is not allowed with cross_step; must be < "
                f"fault.target={self.target}"
            )


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.fired: set[int] = set()  # wall-clock firings (transient faults fire once)
        self.drift_factor = 1.0  # the last solved factor (the next solve's first guess)
        self.drift_start: float | None = None  # |x| max measured at the start step
        self.step = 0  # the model step whose forward runs now (set by begin())
        self.disabled = False  # a transient fault that happened, then was rolled back
        self._armed: list = []  # gradient hooks of the step in flight

    def _mine(self) -> bool:
        return self.cfg.rank is None or self.cfg.rank == self.rank

    def fires(self, step: int) -> bool:
        """Does the point fault fire at this model step (on this rank)?"""
        c = self.cfg
        if self.disabled or c.kind in ("none", "activation_drift") or step != c.step:
            return False
        if not self._mine():
            return False
        if not c.persistent and step in self.fired:
            return False
        self.fired.add(step)
        return True

    # ---- point faults -------------------------------------------------------------------
    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "nan_loss" and self.fires(step):
            return loss * float("nan")
        return loss

    def arm(self, step: int, model: nn.Module) -> None:
        """Before the backward of ``step``: hook the gradients the fault corrupts.

        Tensor hooks run when a gradient is produced, before DDP's all-reduce, so a fault
        on rank r reaches every rank through the reduce, as a real corrupted gradient would
        (corrupting after the reduce would only desynchronise rank r's replica).
        """
        c = self.cfg
        if c.kind not in ("inf_grad", "grad_spike") or not self.fires(step):
            return
        params = dict(model.named_parameters())
        if c.kind == "inf_grad":
            name = c.param or next(iter(params))
            if name not in params:
                raise ValueError(
                    f"fault.param={name!r} is not a parameter; allowed: {list(params)[:8]} ..."
                )

            def poison(g):
                g = g.clone()
                g.view(-1)[0] = float("inf")
                return g

            self._armed = [params[name].register_hook(poison)]
        else:
            self._armed = [p.register_hook(lambda g: g * c.factor) for p in params.values()]

    def disarm(self) -> None:
        """After the backward: the hooks fire for one step only."""
        for h in self._armed:
            h.remove()
        self._armed = []

    # ---- activation drift -----------------------------------------------------------------
    def begin(self, step: int) -> None:
        """The model step the next training forward belongs to (validation reuses it)."""
        self.step = step

    def attach(self, model: nn.Module) -> None:
        if self.cfg.kind != "activation_drift":
            return
        model.h[self.cfg.layer].register_forward_hook(self._drift_hook)

    def _drift_hook(self, module, args, out):
        c = self.cfg
        if self.disabled or not self._mine() or self.step < c.step:
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

    @property
    def happened(self) -> bool:
        """Has the fault fired (point faults) or started (drift)?"""
        return bool(self.fired) or self.drift_start is not None

    def on_rollback(self, snapshot_state: dict) -> None:
        """A rollback rewinds the model: a persistent fault rewinds with it (and recurs); a
        transient one that already happened is over; one that has not happened yet stays."""
        if self.cfg.persistent:
            self.drift_factor = snapshot_state["drift_factor"]
            self.drift_start = snapshot_state["drift_start"]
        elif self.happened:
            self.disabled, self.drift_factor = True, 1.0

    def snapshot_state(self) -> dict:
        """What a rollback rewinds: the drift's course (not the wall-clock firing history)."""
        return {"drift_factor": self.drift_factor, "drift_start": self.drift_start}

    def state_dict(self) -> dict:
        """Everything, for checkpoints: a resumed run neither re-fires nor re-measures."""
        return {**self.snapshot_state(), "fired": sorted(self.fired), "disabled": self.disabled}

    def load_state_dict(self, state: dict) -> None:
        self.drift_factor, self.drift_start = state["drift_factor"], state["drift_start"]
        self.fired = set(state["fired"])
        self.disabled = state["disabled"]
