"""The built-in monitors, registered under their config sections (``monitor.<name>``).

The order here is the suite's order, hence the order of a step's events in events.jsonl.
"""

from __future__ import annotations

from functools import partial

from stabilize.monitors.activations import ActivationConfig, ActivationMonitor
from stabilize.monitors.curvature import CurvatureConfig, CurvatureMonitor
from stabilize.monitors.health import (
    LossScaleConfig,
    LossScaleMonitor,
    NonFiniteConfig,
    NonFiniteMonitor,
)
from stabilize.monitors.logits import (
    AttnEntropyConfig,
    AttnEntropyMonitor,
    AttnLogitConfig,
    AttnLogitMonitor,
    LogZConfig,
    LogZMonitor,
)
from stabilize.monitors.quant import QuantMonitor, QuantMonitorConfig
from stabilize.monitors.registry import register_monitor
from stabilize.monitors.replicas import ReplicasConfig, ReplicasMonitor
from stabilize.monitors.spikes import GradSpikeConfig, LossSpikeConfig, SpikeMonitor

register_monitor("activation", ActivationConfig, ActivationMonitor.from_config)
register_monitor(
    "grad_spike", GradSpikeConfig, partial(SpikeMonitor.from_config, series="grad_norm")
)
register_monitor("loss_spike", LossSpikeConfig, partial(SpikeMonitor.from_config, series="loss"))
register_monitor("nonfinite", NonFiniteConfig, NonFiniteMonitor.from_config, flag=True)
register_monitor("loss_scale", LossScaleConfig, LossScaleMonitor.from_config)
# attention and output logits (monitors/logits.py)
register_monitor("attn_logit", AttnLogitConfig, AttnLogitMonitor.from_config)
register_monitor("attn_entropy", AttnEntropyConfig, AttnEntropyMonitor.from_config)
register_monitor("log_z", LogZConfig, LogZMonitor.from_config)
register_monitor("replicas", ReplicasConfig, ReplicasMonitor.from_config)
# the optimizer's state and the curvature along its update
register_monitor("curvature", CurvatureConfig, CurvatureMonitor.from_config)
# the quantized GEMMs' operands (stabilize/quant/, stability/quant_sites.py)
register_monitor("quant", QuantMonitorConfig, QuantMonitor.from_config)
