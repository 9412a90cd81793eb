"""``FaultInjector``: what the training module and the stability callback hold.

A thin facade over the ``Fault`` that ``cfg.kind`` names in the registry: it builds it,
passes every hook through, and owns the gradient hooks of the step in flight (``arm``
installs them, ``disarm`` removes them after the backward). The drift's ``rate``,
``planned`` and ``_solve`` and its course (``drift_factor``, ``drift_start``) stay
reachable here as before the faults became classes.
"""

from __future__ import annotations

import torch
from torch import nn

from stabilize.faults.base import Fault, fault_class
from stabilize.faults.config import FaultConfig
from stabilize.faults.drift import ActivationDrift


class FaultInjector:
    """The run's one fault (``cfg.kind``, on ``rank``), behind the hooks the module calls."""

    _solve = staticmethod(ActivationDrift._solve)

    def __init__(self, cfg: FaultConfig, rank: int = 0):
        self.cfg = cfg
        self.rank = rank
        # a disabled fault is configured (and recorded) but never fires: no hook at all
        self.fault: Fault = fault_class(cfg.kind if cfg.enabled else "none")(cfg, rank)
        self._armed: list = []  # gradient hooks of the step in flight

    # ---- the state of the fault, as attributes -------------------------------------------
    @property
    def fired(self) -> set[int]:
        """Wall-clock firings (transient faults fire once)."""
        return self.fault.fired

    @fired.setter
    def fired(self, value: set[int]) -> None:
        self.fault.fired = value

    @property
    def disabled(self) -> bool:
        """A transient fault that happened, then was rolled back."""
        return self.fault.disabled

    @disabled.setter
    def disabled(self, value: bool) -> None:
        self.fault.disabled = value

    @property
    def step(self) -> int:
        """The model step whose forward runs now (set by ``begin``)."""
        return self.fault.step

    @property
    def drift_factor(self) -> float:
        """The drift's last solved factor (1.0 for every other kind)."""
        return getattr(self.fault, "drift_factor", 1.0)

    @property
    def drift_start(self) -> float | None:
        """The |x| max the drift measured at its start step (None: not started, or no drift)."""
        return getattr(self.fault, "drift_start", None)

    @property
    def happened(self) -> bool:
        """Has the fault fired (point faults) or started (drift)?"""
        return self.fault.happened

    def outcome(self, fired: bool | None = None) -> dict | None:
        """What the run's armed fault did, for result.json and the final summary: its kind,
        whether it fired (``fired``: the answer of every rank together, when the caller
        reduced it; else this rank's own) and when it would have (``trigger``). None when
        no fault is armed (``kind=none`` or ``enabled=false``): an armed fault that never
        fired is said at the end, not left for the reader to infer from a quiet run."""
        if self.cfg.kind == "none" or not self.cfg.enabled:
            return None
        fired = self.happened if fired is None else fired
        return {"kind": self.cfg.kind, "fired": bool(fired), "trigger": self.fault.trigger()}

    # ---- the module's hooks ----------------------------------------------------------------
    def fires(self, step: int) -> bool:
        """Does the point fault fire at this model step (on this rank)?"""
        return self.fault.fires(step)

    def begin(self, step: int, data_step: int = -1) -> None:
        """The model step the next training forward belongs to (validation reuses it), and
        the data position of its micro-batch."""
        self.fault.begin(step, data_step)

    def attach(self, model: nn.Module) -> None:
        self.fault.attach(model)

    def bind_data(self, blocks) -> None:
        """The training blocks, at train start (a fault on content reads its sequence)."""
        self.fault.bind_data(blocks)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return self.fault.on_loss(step, loss)

    def arm(self, step: int, model: nn.Module) -> None:
        """Before the backward of ``step``: hook the gradients the fault corrupts."""
        self._armed.extend(self.fault.arm(step, model))

    def disarm(self, model: nn.Module | None = None) -> None:
        """After the backward: the hooks fire for one step only; then the fault's
        ``after_backward`` (the gradients are all-reduced by now)."""
        for h in self._armed:
            h.remove()
        self._armed = []
        if model is not None:
            self.fault.after_backward(self.fault.step, model)

    # ---- the drift's path (activation_drift only) ------------------------------------------
    def rate(self) -> float:
        """log-|x|-max growth per step, derived from where the path must be when."""
        return self.fault.rate()

    def planned(self, step: int) -> float:
        """The |x| max the drift pins block ``layer``'s output to at ``step``."""
        return self.fault.planned(step)

    # ---- rollback and checkpoints ----------------------------------------------------------
    def on_rollback(self, snapshot_state: dict) -> None:
        """A rollback rewinds the model: a persistent fault rewinds with it (and recurs); a
        transient one that already happened is over; one that has not happened yet stays."""
        self.fault.on_rollback(snapshot_state)

    def snapshot_state(self) -> dict:
        """What a rollback rewinds: the fault's course (not the wall-clock firing history).

        Every kind's state carries the drift's two keys, as before the kinds became classes,
        so checkpoints written before and after that change resume each other."""
        legacy = {"drift_factor": self.drift_factor, "drift_start": self.drift_start}
        return {**legacy, **self.fault.snapshot_state()}

    def state_dict(self) -> dict:
        """Everything, for checkpoints: a resumed run neither re-fires nor re-measures."""
        return {**self.snapshot_state(), **self.fault.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.fault.load_state_dict(state)
