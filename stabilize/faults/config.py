"""``FaultConfig``: the ``fault`` settings every kind shares (the Hydra ``fault=`` group,
configs/fault/), the registry of kinds, and ``fault_config``, which builds a kind's config.

Each kind registers its class and its config dataclass (``Fault.config``): ``FaultConfig``
itself for a kind with no settings of its own, else a subclass that adds only the kind's
knobs (``GradSpikeConfig``: ``factor``). ``fault_config`` picks the dataclass by
``fault.kind``, so ``fault.factor`` is a setting of ``grad_spike`` only, and a knob of
another kind is refused with the key, the value and the kind's keys. The dataclass holds
the kind's defaults: ``fault=<kind>`` composes them (stabilize/config_store.py), and
configs/fault/<kind>.yaml, where a kind has one, only what differs (tests/test_configs.py).

This module imports no fault class (``base.py`` imports it): the kind's own cross-field
checks are called through the registry (``Fault.validate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stabilize.registry import Registry
from stabilize.validate import ConfigError, build_dataclass, check_positive

FAULTS: Registry = Registry("fault.kind")
"""kind -> its ``Fault`` class, with its config dataclass (``FAULTS.config(kind)``)."""


@dataclass
class FaultConfig:
    """The keys of every kind; a kind with knobs registers a subclass holding them."""

    kind: str = "none"
    """A registered fault kind (``stabilize.faults.fault_kinds()``); ``none``: no fault."""
    step: int = 100
    """The model step it fires at (drift: where it starts)."""
    rank: int | None = None
    """The rank it fires on; None: every rank (a ``bitflip`` on every rank leaves the
    replicas agreeing: set one rank)."""
    persistent: bool = False
    """True: fires again each time the model reaches ``step`` (a deterministic bug, recurs
    after a rollback); False: once per run (a transient fault)."""
    enabled: bool = True
    """False: the configured fault never fires (its settings stay checked and recorded):
    a scenario's healthy reference is its fault run with ``fault.enabled=false``."""

    def __post_init__(self):
        want = FAULTS.config(self.kind)  # an unknown kind fails with the registered ones
        if type(self) is not want:
            raise ConfigError(
                f"fault.kind={self.kind!r} is not allowed in a {type(self).__name__}; its "
                f"settings are a {want.__name__} (build it with fault_config(kind=...))"
            )
        check_positive("fault.step", self.step, integer=True)
        # The upper bounds (max_steps, the world size) are checked where they are known:
        # RunConfig and the start-up checks (stabilize/run/preflight.py).
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0
        ):
            raise ConfigError(
                f"fault.rank={self.rank!r} is not allowed; allowed: null (every rank) or a "
                "rank in [0, world size)"
            )
        self.check()
        FAULTS[self.kind].validate(self)

    def check(self) -> None:
        """The kind's own knobs, one by one (a subclass overrides this)."""


def fault_config(values: Mapping[str, Any] | FaultConfig | None = None, /, **kw: Any):
    """The config of the kind ``fault.kind`` names, from a mapping of settings (or keyword
    arguments); an instance passes through. A key that is not a setting of that kind is
    refused with the key, its value and the kind's keys."""
    if isinstance(values, FaultConfig):
        return build_dataclass(type(values), values, "fault")
    if values is not None and not isinstance(values, Mapping):
        raise ConfigError(f"fault={values!r} is not allowed; expected a mapping of settings")
    values = {**(values or {}), **kw}
    kind = values.get("kind", FaultConfig.kind)
    cls = FAULTS.config(kind)
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in allowed:
            raise ConfigError(
                f"fault.{key}={values[key]!r} is not a setting of fault.kind={kind!r}; "
                f"allowed: {allowed}"
            )
    return build_dataclass(cls, values, "fault")
