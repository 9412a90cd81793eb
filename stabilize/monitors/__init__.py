"""Trainer-agnostic stability monitors: ``update(stats) -> list[Event]`` plus state dicts.

They read host-side ``StepStats`` (gathered once per step by the Lightning callback) and
know nothing of Lightning, W&B or torch.distributed. Each is registered under its config
section (``registry.register_monitor``; the built-in ones in ``builtin.py``). See
docs/monitors.md.
"""

from stabilize.monitors import builtin  # noqa: F401  (registers the built-in monitors)
from stabilize.monitors.activations import ActivationConfig, ActivationMonitor, theil_sen_slope
from stabilize.monitors.events import (
    ABORT,
    INFO,
    ROLLBACK,
    SERIES_METRICS,
    SKIP,
    STEP_FIELDS,
    WARN,
    Event,
    StepStats,
    verdict,
)
from stabilize.monitors.forecast import ForecastConfig
from stabilize.monitors.health import (
    LossScaleConfig,
    LossScaleMonitor,
    NonFiniteConfig,
    NonFiniteMonitor,
)
from stabilize.monitors.registry import MONITORS, Monitor, register_monitor, unregister_monitor
from stabilize.monitors.spikes import (
    GradSpikeConfig,
    LossSpikeConfig,
    SpikeConfig,
    SpikeDetector,
    SpikeMonitor,
)
from stabilize.monitors.suite import MonitorConfig, MonitorSuite

__all__ = [
    "ABORT",
    "INFO",
    "MONITORS",
    "ROLLBACK",
    "SERIES_METRICS",
    "SKIP",
    "STEP_FIELDS",
    "WARN",
    "ActivationConfig",
    "ActivationMonitor",
    "Event",
    "ForecastConfig",
    "GradSpikeConfig",
    "LossScaleConfig",
    "LossScaleMonitor",
    "LossSpikeConfig",
    "Monitor",
    "MonitorConfig",
    "MonitorSuite",
    "NonFiniteConfig",
    "NonFiniteMonitor",
    "SpikeConfig",
    "SpikeDetector",
    "SpikeMonitor",
    "StepStats",
    "register_monitor",
    "theil_sen_slope",
    "unregister_monitor",
    "verdict",
]
