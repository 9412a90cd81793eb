"""The ``Monitor`` interface and the registry that maps a config section to a monitor.

A monitor is registered under the name of its section in ``configs/monitor/*.yaml``
(``monitor.<name>.*``) with its own config dataclass; ``MonitorConfig`` accepts exactly the
registered sections and ``MonitorSuite`` builds and runs the enabled ones in registration
order (the order of their events within a step). Built-in monitors are registered in
``stabilize/monitors/builtin.py``; a monitor from outside the package calls
``register_monitor`` before the run's config is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from stabilize.monitors.events import Event, StepStats


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
    """Its config dataclass; must have an ``enabled`` field."""
    build: Callable[[str, Any], Monitor]
    """(name, config) -> the monitor."""
    defaults: Mapping[str, Any]
    """This section's defaults where they differ from the dataclass's (two sections may
    share one config class, e.g. grad_spike and loss_spike)."""
    flag: bool
    """The section may be written as a bare bool (``nonfinite: true``): its ``enabled``."""


MONITORS: dict[str, MonitorEntry] = {}


def register_monitor(
    name: str,
    config: type,
    build: Callable[[str, Any], Monitor],
    *,
    defaults: Mapping[str, Any] | None = None,
    flag: bool = False,
) -> None:
    """Register a monitor under its config section ``name`` (appended: it runs last)."""
    if name in MONITORS or name == "enabled":
        raise ValueError(f"monitor {name!r} is already registered (or reserved)")
    names = {f.name for f in dataclasses.fields(config)}
    if "enabled" not in names:
        raise ValueError(f"monitor {name!r}: its config {config.__name__} needs an `enabled` field")
    defaults = dict(defaults or {})
    config(**defaults)  # the defaults themselves must be valid settings
    MONITORS[name] = MonitorEntry(name, config, build, defaults, flag)


def unregister_monitor(name: str) -> None:
    """Remove a registered monitor (tests registering their own clean up with this)."""
    del MONITORS[name]
