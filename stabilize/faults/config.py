"""``FaultConfig``: the ``fault`` settings (the Hydra ``fault=`` group, configs/fault/).

One flat dataclass for every kind, so each YAML of the group lists every key and an
override such as ``fault.kind=grad_spike fault.factor=1e4`` composes on any of them. The
kind's own cross-field checks live with its class (``Fault.validate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from stabilize.faults.base import fault_class
from stabilize.validate import ConfigError, check_choice, check_positive, check_range


@dataclass
class FaultConfig:
    kind: str = "none"
    """A registered fault kind (``stabilize.faults.fault_kinds()``); ``none``: no fault."""
    step: int = 100
    """The model step it fires at (drift: where it starts)."""
    rank: int | None = None
    """The rank it fires on; None: every rank."""
    persistent: bool = False
    """True: fires again each time the model reaches ``step`` (a deterministic bug, recurs
    after a rollback); False: once per run (a transient fault)."""
    factor: float = 100.0
    """grad_spike: gradients multiplied by this."""
    param: str | None = None
    """inf_grad: the parameter whose gradient turns inf (None: the first one)."""
    layer: int = 0
    """activation_drift: the block whose output drifts."""
    target: float = 1e4
    """activation_drift: the |x| max to reach ..."""
    target_step: int | None = 150
    """... at this step, or (None) at the rate ``cross_step`` sets."""
    cross_step: int | None = None
    """activation_drift: |x| max first passes ``cross`` at this step (the rate follows)."""
    cross: float = 256.0
    """The line ``cross_step`` refers to (256: the first fp16 square that is inf)."""
    channels: int | None = None
    """activation_drift: drift only the first k channels, an outlier feature (None: all)."""
    keep_growing: bool = False
    """activation_drift past the target: hold (False) or keep the rate (True)."""
    batch: int | None = None
    """poisoned_batch: the data position (micro-batch number, ``data_step``) whose batch
    gives a non-finite loss every time it is trained on."""
    bit: int = 20
    """bitflip: the bit flipped in element 0 of ``param`` (0: the lowest mantissa bit of an
    fp32; 23-30: the exponent, a huge or tiny value; 31: the sign)."""
    flip: str = "param"
    """bitflip: flip the parameter itself (silent: only the replica check sees it) or its
    gradient (``grad``), after the all-reduce, on ``rank`` only."""

    def __post_init__(self):
        cls = fault_class(self.kind)  # an unknown kind fails with the registered ones
        # every key is checked whatever the kind: the group's YAMLs carry them all
        check_positive("fault.step", self.step, integer=True)
        check_positive("fault.factor", self.factor)
        check_positive("fault.target", self.target)
        check_positive("fault.cross", self.cross)
        if self.batch is not None:
            check_range("fault.batch", self.batch, 0, float("inf"))
        if isinstance(self.bit, bool) or not isinstance(self.bit, int) or not 0 <= self.bit < 32:
            raise ConfigError(f"fault.bit={self.bit!r} is not allowed; allowed: an int in [0, 32)")
        check_choice("fault.flip", self.flip, ("param", "grad"))
        if self.channels is not None:
            check_positive("fault.channels", self.channels, integer=True)
        # The upper bounds (max_steps, the world size) are checked where they are known:
        # RunConfig and the start-up checks (stabilize/lit/preflight.py).
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0
        ):
            raise ConfigError(
                f"fault.rank={self.rank!r} is not allowed; allowed: null (every rank) or a "
                "rank in [0, world size)"
            )
        cls.validate(self)
