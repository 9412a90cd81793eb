"""Trainer-agnostic stability monitors: ``update(...) -> list[Event]`` plus state dicts.

They read host-side ``StepStats`` (gathered once per step by the Lightning callback) and
know nothing of Lightning, W&B or torch.distributed. See docs/stability.md.
"""

from stabilize.monitors.activations import ActivationMonitor, theil_sen_slope
from stabilize.monitors.events import (
    ABORT,
    INFO,
    ROLLBACK,
    SKIP,
    WARN,
    Event,
    StepStats,
    verdict,
)
from stabilize.monitors.health import LossScaleMonitor, NonFiniteMonitor
from stabilize.monitors.spikes import SpikeDetector
from stabilize.monitors.suite import MonitorConfig, MonitorSuite

__all__ = [
    "ABORT",
    "INFO",
    "ROLLBACK",
    "SKIP",
    "WARN",
    "ActivationMonitor",
    "Event",
    "LossScaleMonitor",
    "MonitorConfig",
    "MonitorSuite",
    "NonFiniteMonitor",
    "SpikeDetector",
    "StepStats",
    "theil_sen_slope",
    "verdict",
]
