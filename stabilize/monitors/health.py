"""NaN/Inf in loss and gradients, and fp16 loss-scale collapse.

In fp16 a non-finite gradient is routine: the GradScaler skips that step and halves the
scale. Such a step is a *scaler skip*, counted and logged, not a NaN event. It becomes a
fault when the scale collapses: below a floor, or too many skips in a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.monitors.events import ROLLBACK, SKIP, Event, StepStats
from stabilize.validate import check_positive


@dataclass
class NonFiniteConfig:
    """``monitor.nonfinite``: written as a bare bool in the YAML (``nonfinite: true``)."""

    enabled: bool = True
    """Roll back on a non-finite loss, or gradient norm outside fp16 (the scaler's case)."""


@dataclass
class LossScaleConfig:
    """``monitor.loss_scale``: fp16 loss-scale collapse."""

    enabled: bool = True
    """Run this monitor (it is silent without a GradScaler)."""
    floor: float = 1.0
    """A loss scale below this is a collapse: roll back."""
    max_consecutive_skips: int = 10
    """More scaler skips in a row than this: roll back."""

    def __post_init__(self):
        check_positive("monitor.loss_scale.floor", self.floor)
        check_positive(
            "monitor.loss_scale.max_consecutive_skips", self.max_consecutive_skips, integer=True
        )


class NonFiniteMonitor:
    name = "nonfinite"
    needs = ("loss", "grad_norm", "loss_scale")

    @classmethod
    def from_config(cls, name: str, c: NonFiniteConfig) -> NonFiniteMonitor:
        return cls()

    def update(self, stats: StepStats) -> list[Event]:
        if not math.isfinite(stats.loss):
            return [
                Event(
                    ROLLBACK,
                    "nonfinite",
                    stats.step,
                    f"loss is {stats.loss} at step {stats.step}",
                    value=stats.loss,
                )
            ]
        g = stats.grad_norm
        if g is not None and not math.isfinite(g) and stats.loss_scale is None:
            return [
                Event(
                    ROLLBACK,
                    "nonfinite",
                    stats.step,
                    f"gradient norm is {g} at step {stats.step}",
                    value=g,
                )
            ]
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LossScaleMonitor:
    name = "loss_scale"
    needs = ("loss_scale", "scaler_skipped")

    @classmethod
    def from_config(cls, name: str, c: LossScaleConfig) -> LossScaleMonitor:
        return cls(c)

    def __init__(self, c: LossScaleConfig | None = None):
        """Built from ``monitor.loss_scale``'s settings (None: the dataclass's defaults)."""
        self.c = c = c or LossScaleConfig()
        self.floor, self.max_skips = c.floor, c.max_consecutive_skips
        self.consecutive = 0
        self.total_skips = 0

    def update(self, stats: StepStats) -> list[Event]:
        if stats.loss_scale is None:  # not an fp16 run
            return []
        events = []
        if stats.scaler_skipped:
            self.consecutive += 1
            self.total_skips += 1
            events.append(
                Event(
                    SKIP,
                    "loss_scale",
                    stats.step,
                    f"GradScaler skips step {stats.step} (inf/NaN gradients); "
                    f"scale {stats.loss_scale:g}, halved after this step",
                    value=stats.loss_scale,
                    extra={"consecutive": self.consecutive},
                )
            )
        else:
            self.consecutive = 0
        if stats.loss_scale < self.floor:
            events.append(
                Event(
                    ROLLBACK,
                    "loss_scale",
                    stats.step,
                    f"loss scale collapsed to {stats.loss_scale:g} (floor {self.floor:g})",
                    value=stats.loss_scale,
                    threshold=self.floor,
                )
            )
        elif self.consecutive > self.max_skips:
            events.append(
                Event(
                    ROLLBACK,
                    "loss_scale",
                    stats.step,
                    f"{self.consecutive} consecutive scaler skips (max {self.max_skips})",
                    value=float(self.consecutive),
                    threshold=float(self.max_skips),
                )
            )
        return events

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total_skips": self.total_skips}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.total_skips = state["consecutive"], state["total_skips"]
