"""Step-targeted, rank-targeted fault injection, for tests and failure scenarios.

One class per fault kind (``base.Fault``: hooks on the loss, the gradients and the
forward, rollback and checkpoint state), registered by name (``base.register_fault``);
``fault.kind`` (``FaultConfig``, the Hydra ``fault=`` group) picks one and
``FaultInjector`` drives it.

Kinds: ``none``, ``nan_loss``, ``inf_grad``, ``grad_spike``, ``loss_spike`` (``point.py``),
``activation_drift`` (``drift.py``), ``stream_drift`` (``stream.py``), ``bitflip``,
``poisoned_batch`` and ``poisoned_item`` (``silent.py``), ``biased_round`` (``rounding.py``),
``value_growth`` (``value_growth.py``).
Each has its config dataclass (``FaultConfig``'s common keys plus its own knobs);
``fault_config`` builds the one ``fault.kind`` names. To add one: subclass ``PointFault``
(or ``Fault``), set ``kind`` and ``config`` (a ``FaultConfig`` subclass with its knobs),
override the hooks it needs, decorate it with ``@register_fault`` and import its module
below: ``fault=<kind>`` then composes its dataclass's defaults. A ``configs/fault/<kind>.yaml``
is optional (the built-in kinds have one: a comment, its ``kind``, what differs from those
defaults).
"""

from stabilize.faults.base import (
    Fault,
    PointFault,
    fault_class,
    fault_kinds,
    register_fault,
    unregister_fault,
)
from stabilize.faults.config import FaultConfig, fault_config

# The built-in kinds register on import, in this order (the order of the allowed values).
# isort: off
from stabilize.faults.point import GradSpike, GradSpikeFaultConfig, InfGrad, InfGradConfig
from stabilize.faults.point import NanLoss, NoFault
from stabilize.faults.drift import ActivationDrift, ActivationDriftConfig
from stabilize.faults.stream import StreamDrift
from stabilize.faults.silent import BitFlip, BitFlipConfig, PoisonedBatch, PoisonedBatchConfig
from stabilize.faults.rounding import BiasedRound, BiasedRoundConfig
from stabilize.faults.value_growth import ValueGrowth, ValueGrowthConfig
from stabilize.faults.injector import FaultInjector
# isort: on

__all__ = [
    "ActivationDrift",
    "ActivationDriftConfig",
    "BitFlip",
    "BitFlipConfig",
    "BiasedRound",
    "BiasedRoundConfig",
    "Fault",
    "FaultConfig",
    "FaultInjector",
    "GradSpike",
    "GradSpikeFaultConfig",
    "InfGrad",
    "InfGradConfig",
    "NanLoss",
    "NoFault",
    "PointFault",
    "PoisonedBatch",
    "PoisonedBatchConfig",
    "StreamDrift",
    "ValueGrowth",
    "ValueGrowthConfig",
    "fault_class",
    "fault_config",
    "fault_kinds",
    "register_fault",
    "unregister_fault",
]
