"""Step-targeted, rank-targeted fault injection, for tests and failure scenarios.

Faults are keyed on the model's own step. A *persistent* fault fires every time the model
reaches its step, so it recurs after a rollback rewinds the model (a deterministic bug); a
*transient* one fires once per run (a flipped bit, a bad host).

Activation drift models a residual stream drifting towards ~1e4: from ``step`` on, block
``layer``'s residual update (output - input) is multiplied by a factor f. The factor is
steered so that the stream's |x| max after that block follows a geometric path from the
value measured at ``step`` to ``target`` at ``target_step`` — the rate is derived from the
target step, not hard-coded — then holds (or keeps growing at the same rate). Steering is
closed-loop on the |x| max the monitors measure each step: the optimizer reacts to the
drift, and an open-loop factor would miss the target step.
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
    target_step: int = 150  # ... at this step
    keep_growing: bool = False  # after target_step: hold (False) or keep the rate (True)

    def __post_init__(self):
        check_choice("fault.kind", self.kind, FAULT_KINDS)
        check_positive("fault.step", self.step, integer=True)
        check_positive("fault.factor", self.factor)
        check_positive("fault.target", self.target)
        if self.kind == "activation_drift" and self.target_step <= self.step:
            raise ValueError(
                f"fault.target_step={self.target_step} is not allowed; must be > "
                f"fault.step={self.step}"
            )


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.fired: set[int] = set()  # wall-clock firings (transient faults fire once)
        self.drift_factor = 1.0
        self.drift_start: float | None = None  # |x| max measured at the start step
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
    def attach(self, model: nn.Module) -> None:
        if self.cfg.kind != "activation_drift":
            return
        block = model.h[self.cfg.layer]

        def hook(module, args, out):  # scale the residual update of this block
            if self.drift_factor == 1.0 or self.disabled:
                return out
            x = args[0]
            return x + (out - x) * self.drift_factor

        block.register_forward_hook(hook)

    def planned(self, step: int) -> float:
        """The |x| max the drift aims at for ``step`` (geometric from start to target)."""
        c = self.cfg
        span = c.target_step - c.step
        rate = math.log(c.target / self.drift_start) / span
        k = step - c.step
        if not c.keep_growing:
            k = min(k, span)
        return self.drift_start * math.exp(rate * k)

    def steer(self, next_step: int, measured: float | None) -> None:
        """Set the factor for ``next_step`` from the |x| max measured at the step before.

        Closed loop: f <- f * planned / measured, each move clamped to [1/4, 4] so one noisy
        reading cannot throw it. Only this rank's schedule changes; the measurement is the
        all-rank maximum, so every rank steers identically.
        """
        c = self.cfg
        if c.kind != "activation_drift" or self.disabled or not self._mine() or measured is None:
            return
        if next_step <= c.step:
            return
        if self.drift_start is None:
            if not math.isfinite(measured) or measured <= 0:
                return
            self.drift_start = measured
        if not math.isfinite(measured) or measured <= 0:
            return
        ratio = self.planned(next_step) / measured
        self.drift_factor *= min(4.0, max(0.25, ratio))

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
