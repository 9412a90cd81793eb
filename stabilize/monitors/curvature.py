"""``monitor.curvature``: the optimizer-state series of issue 38 (docs/design-spikes.md).

On log steps the probe records, per block and for the whole model, AdamW's mean g^2 / v_hat
and the update/weight ratio; on one log step in ``every`` also the curvature along the
update and its preconditioned form (stability/curvature.py: two extra forward and backward
passes of the step's batches, in fp32), logged as ``opt/curv_u`` and ``opt/curv_pre`` beside their
stability lines ``opt/edge_gd`` (2 / lr) and ``opt/edge_adam`` ((2 + 2 beta1) / ((1 -
beta1) lr)). This monitor emits no event yet: the forecast on these series is scored
before it is trusted (issue 38)."""

from __future__ import annotations

from dataclasses import dataclass

from stabilize.monitors.events import Event, StepStats
from stabilize.validate import check_count, check_range


@dataclass
class CurvatureConfig:
    """``monitor.curvature``: the curvature along the optimizer's update."""

    enabled: bool = True
    """Measure it (g^2 / v_hat and the update ratio are measured on every log step)."""
    every: int = 10
    """On one log step in this many (0: never): two extra forward and backward passes then."""
    rel: float = 1e-4
    """The difference quotient's step, ||h u|| / ||theta||."""

    def __post_init__(self):
        check_count("monitor.curvature.every", self.every)
        check_range("monitor.curvature.rel", self.rel, 1e-6, 1e-1)


class CurvatureMonitor:
    name = "curvature"
    needs = ("opt",)

    @classmethod
    def from_config(cls, name: str, c: CurvatureConfig) -> CurvatureMonitor:
        return cls()

    def update(self, stats: StepStats) -> list[Event]:
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
