"""The monitor group's config and the suite that runs every enabled monitor on a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from stabilize.monitors.activations import ActivationMonitor
from stabilize.monitors.events import ROLLBACK, WARN, Event, StepStats
from stabilize.monitors.health import LossScaleMonitor, NonFiniteMonitor
from stabilize.monitors.spikes import SpikeDetector
from stabilize.validate import build_dataclass, check_choice, check_positive


@dataclass
class ActivationConfig:
    enabled: bool = True
    threshold: float = 256.0  # the fp16 square-overflow line
    horizon: int = 100  # forecast warning: crossing expected within this many steps
    window: int = 32  # steps in the forecast's robust fit
    forecast_min: float = 8.0  # no forecast warning below this |x| max
    forecast_every: int = 10  # refit the forecast every N steps
    on_overflow: str = "warn"  # warn | rollback, when a norm's reduction overflows

    def __post_init__(self):
        check_positive("monitor.activation.threshold", self.threshold)
        check_positive("monitor.activation.horizon", self.horizon, integer=True)
        check_positive("monitor.activation.window", self.window, integer=True)
        check_positive("monitor.activation.forecast_min", self.forecast_min)
        check_positive("monitor.activation.forecast_every", self.forecast_every, integer=True)
        check_choice("monitor.activation.on_overflow", self.on_overflow, ("warn", "rollback"))


@dataclass
class SpikeConfig:
    enabled: bool = True
    window: int = 100
    warmup: int = 20
    threshold: float = 6.0  # robust z-score (median/MAD)
    min_ratio: float = 1.5  # and value > min_ratio x median
    action: str = "rollback"  # warn | rollback

    def __post_init__(self):
        for k in ("window", "warmup"):
            check_positive(f"monitor.spike.{k}", getattr(self, k), integer=True)
        check_positive("monitor.spike.threshold", self.threshold)
        check_positive("monitor.spike.min_ratio", self.min_ratio)
        check_choice("monitor.spike.action", self.action, ("warn", "rollback"))


@dataclass
class LossScaleConfig:
    enabled: bool = True
    floor: float = 1.0
    max_consecutive_skips: int = 10

    def __post_init__(self):
        check_positive("monitor.loss_scale.floor", self.floor)
        check_positive(
            "monitor.loss_scale.max_consecutive_skips", self.max_consecutive_skips, integer=True
        )


@dataclass
class MonitorConfig:
    enabled: bool = True  # all monitors (and their per-step statistics) on/off
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    # Gradient clipping absorbs most grad-norm spikes, and small batches have real 10-20x
    # ones (measured on the tiny model): warn by default. A loss spike is the PaLM case.
    grad_spike: SpikeConfig = field(
        default_factory=lambda: SpikeConfig(warmup=50, threshold=8.0, min_ratio=4.0, action="warn")
    )
    loss_spike: SpikeConfig = field(
        default_factory=lambda: SpikeConfig(warmup=50, threshold=8.0, min_ratio=1.5)
    )
    nonfinite: bool = True
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)

    def __post_init__(self):
        self.activation = build_dataclass(ActivationConfig, self.activation, "monitor.activation")
        self.grad_spike = build_dataclass(SpikeConfig, self.grad_spike, "monitor.grad_spike")
        self.loss_spike = build_dataclass(SpikeConfig, self.loss_spike, "monitor.loss_spike")
        self.loss_scale = build_dataclass(LossScaleConfig, self.loss_scale, "monitor.loss_scale")


class MonitorSuite:
    """Runs the enabled monitors in a fixed order; checkpointable as one state dict."""

    def __init__(self, cfg: MonitorConfig):
        self.monitors: dict[str, object] = {}
        if not cfg.enabled:
            return
        a = cfg.activation
        if a.enabled:
            self.monitors["activation"] = ActivationMonitor(
                a.threshold,
                a.horizon,
                a.window,
                on_overflow=a.on_overflow,
                forecast_min=a.forecast_min,
                forecast_every=a.forecast_every,
            )
        for name in ("grad_spike", "loss_spike"):
            s = getattr(cfg, name)
            if s.enabled:
                kind = ROLLBACK if s.action == "rollback" else WARN
                self.monitors[name] = SpikeDetector(
                    name, s.window, s.warmup, s.threshold, s.min_ratio, kind=kind
                )
        if cfg.nonfinite:
            self.monitors["nonfinite"] = NonFiniteMonitor()
        if cfg.loss_scale.enabled:
            ls = cfg.loss_scale
            self.monitors["loss_scale"] = LossScaleMonitor(ls.floor, ls.max_consecutive_skips)

    def update(self, stats: StepStats) -> list[Event]:
        events: list[Event] = []
        for name, m in self.monitors.items():
            if name == "grad_spike":
                events += m.update(stats.step, stats.grad_norm)
            elif name == "loss_spike":
                events += m.update(stats.step, stats.loss)
            else:
                events += m.update(stats)
        return events

    @property
    def forecast(self) -> dict[str, float]:
        act = self.monitors.get("activation")
        return act.forecast if act is not None else {}

    def state_dict(self) -> dict:
        return {k: m.state_dict() for k, m in self.monitors.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, m in self.monitors.items():
            if k in state:
                m.load_state_dict(state[k])
