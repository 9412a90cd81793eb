"""The ``Monitor`` interface and the registry that maps a config section to a monitor.

A monitor is registered under the name of its config section (``monitor.<name>.*``) with
its own config dataclass, whose defaults are the section's: the composed config holds one
section per registered monitor (stabilize/config_store.py), ``MonitorConfig`` accepts exactly
the registered sections and ``MonitorSuite`` builds and runs the enabled ones in registration
order (the order of their events within a step). Built-in monitors are registered in
``stabilize/monitors/builtin.py``; a monitor from outside the package calls
``register_monitor`` before the run's config is composed (its settings then need no ``+``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stabilize.monitors.events import Event, StepStats
from stabilize.registry import Registry, origin


@runtime_checkable
class Monitor(Protocol):
    """What the suite calls. Trainer-agnostic: host numbers in, events out.

    ``update`` takes the whole ``StepStats`` (its ``step`` included) rather than
    ``(step, stats)``: the step is one of the stats, and the built-in monitors' tested
    signature stays as it is. ``needs`` names the StepStats fields the monitor reads
    (``events.STEP_FIELDS``); the suite refuses a name no probe fills.

    Optional: a ``forecast`` attribute (layer -> steps left before a line is crossed),
    logged as ``forecast/<layer>`` and put in an abort's diagnosis.
    """

    name: str
    needs: tuple[str, ...]

    def update(self, stats: StepStats) -> list[Event]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class MonitorEntry:
    """One registered monitor."""

    name: str
    """The config section (``monitor.<name>``) and the suite's key."""
    config: type
    """Its config dataclass; must have an ``enabled`` field. Its defaults are the
    section's defaults (two sections share a detector through two subclasses, e.g.
    ``GradSpikeConfig`` and ``LossSpikeConfig``)."""
    build: Callable[[str, Any], Monitor]
    """(name, config) -> the monitor."""
    flag: bool
    """The section may be written as a bare bool (``nonfinite: true``): its ``enabled``."""

    @property
    def registered_by(self) -> str:
        return origin(self.config)


MONITORS: Registry[MonitorEntry] = Registry("monitor", reserved=("enabled",))


def register_monitor(
    name: str, config: type, build: Callable[[str, Any], Monitor], *, flag: bool = False
) -> None:
    """Register a monitor under its config section ``name`` (appended: it runs last)."""
    names = {f.name for f in dataclasses.fields(config)}
    if "enabled" not in names:
        raise ValueError(f"monitor {name!r}: its config {config.__name__} needs an `enabled` field")
    config()  # the defaults themselves must be valid settings
    MONITORS.register(name, MonitorEntry(name, config, build, flag), config)


def unregister_monitor(name: str) -> None:
    """Remove a registered monitor (tests registering their own clean up with this)."""
    MONITORS.unregister(name)
