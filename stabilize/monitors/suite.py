"""The monitor group's config and the suite that runs every enabled monitor on a step.

Both follow the registry (stabilize/monitors/registry.py): ``MonitorConfig`` holds one
section per registered monitor, ``MonitorSuite`` builds the enabled ones and runs them in
registration order. Neither knows any monitor by name.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from stabilize.monitors.events import STEP_FIELDS, Event, StepStats
from stabilize.monitors.registry import MONITORS, Monitor
from stabilize.validate import check_choice


class MonitorConfig:
    """``monitor``: ``enabled`` (all monitors and their per-step statistics on/off) and one
    section per registered monitor, ``monitor.<name>``, built into that monitor's own config
    dataclass (``cfg.activation``, ``cfg.grad_spike``, ...). A section left out takes its
    registered defaults; an unknown one is refused with the registered names."""

    enabled: bool
    """Every monitor and the per-step statistics they read (false, ``monitor=off``: none,
    the NaN check included)."""

    def __init__(self, enabled: bool = True, **sections: Any):
        self.enabled = enabled

        def bare_flag(name: str, value: Any) -> Any:
            return {"enabled": value} if MONITORS[name].flag and isinstance(value, bool) else value

        self.sections: dict[str, Any] = MONITORS.build_sections(
            sections, "monitor", also_allowed=["enabled"], prepare=bare_flag
        )

    @classmethod
    def build(cls, value: Any, key: str = "monitor") -> MonitorConfig:
        """From a mapping (the composed YAML), or an instance as it is."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r} is not allowed; expected a mapping of settings")
        return cls(**value)

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The config as the YAML writes it (a ``flag`` section as its bool)."""
        out: dict[str, Any] = {"enabled": self.enabled}
        for name, c in self.sections.items():
            flag = name in MONITORS and MONITORS[name].flag
            out[name] = c.enabled if flag else asdict(c)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MonitorConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"MonitorConfig({self.to_dict()!r})"


class MonitorSuite:
    """Runs the enabled monitors in registration order; checkpointable as one state dict."""

    def __init__(self, cfg: MonitorConfig):
        self.monitors: dict[str, Monitor] = {}
        if not cfg.enabled:
            return
        for name, section in cfg.sections.items():
            if section.enabled:
                m = MONITORS[name].build(name, section)
                for need in m.needs:
                    check_choice(f"monitor.{name} needs", need, STEP_FIELDS)
                self.monitors[name] = m

    @property
    def needs(self) -> set[str]:
        """The StepStats fields the enabled monitors read."""
        return {n for m in self.monitors.values() for n in m.needs}

    def update(self, stats: StepStats) -> list[Event]:
        events: list[Event] = []
        for m in self.monitors.values():
            events += m.update(stats)
        return events

    @property
    def forecast(self) -> dict[str, float]:
        """Steps left before a line is crossed, per layer, from the monitors that forecast."""
        out: dict[str, float] = {}
        for m in self.monitors.values():
            out.update(getattr(m, "forecast", {}))
        return out

    def state_dict(self) -> dict:
        return {k: m.state_dict() for k, m in self.monitors.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, m in self.monitors.items():
            if k in state:
                m.load_state_dict(state[k])
