"""A monitor and a remedy registered from outside the package run in real training runs."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import pytest
from test_stability import BASE, events

from stabilize.monitors import (
    MONITORS,
    WARN,
    Event,
    MonitorConfig,
    MonitorSuite,
    StepStats,
    register_monitor,
    unregister_monitor,
)
from stabilize.norms import Norm
from stabilize.rollback import REMEDIES, Remedy, register_remedy, unregister_remedy
from stabilize.train import run

from conftest import compose_run


# ---- a monitor ------------------------------------------------------------------------------
@dataclass
class LossCeilingConfig:
    """``monitor.loss_ceiling``: warn while the loss is above a line."""

    enabled: bool = True
    """Run this monitor."""
    threshold: float = 100.0
    """Warn when the step's loss exceeds this."""


class LossCeiling:
    needs = ("loss",)

    def __init__(self, name: str, cfg: LossCeilingConfig):
        self.name, self.threshold = name, cfg.threshold
        self.fired = 0

    def update(self, stats: StepStats) -> list[Event]:
        if stats.loss <= self.threshold:
            return []
        self.fired += 1
        return [
            Event(
                WARN,
                self.name,
                stats.step,
                f"loss {stats.loss:.3f} above {self.threshold:g}",
                value=stats.loss,
                threshold=self.threshold,
            )
        ]

    def state_dict(self) -> dict:
        return {"fired": self.fired}

    def load_state_dict(self, state: dict) -> None:
        self.fired = state["fired"]


@pytest.fixture
def loss_ceiling():
    register_monitor("loss_ceiling", LossCeilingConfig, LossCeiling)
    yield
    unregister_monitor("loss_ceiling")


def test_a_registered_monitor_runs_in_training_and_its_events_reach_events_jsonl(
    tmp_path, loss_ceiling
):
    # a tiny byte-level model starts near ln(256) = 5.5 and stays above 4 for a few steps
    cfg = compose_run(
        tmp_path, [*BASE, "trainer.max_steps=6", "monitor.loss_ceiling.threshold=4.0"]
    )
    assert cfg.monitor.loss_ceiling.threshold == 4.0
    assert cfg.to_dict()["monitor"]["loss_ceiling"] == {"enabled": True, "threshold": 4.0}
    assert list(MonitorSuite(cfg.monitor).monitors)[-1] == "loss_ceiling"  # registered last
    run(cfg)
    mine = [e for e in events(tmp_path) if e["monitor"] == "loss_ceiling"]
    assert mine and all(e["kind"] == "warn" and e["value"] > 4.0 for e in mine)
    assert [e["step"] for e in mine] == list(range(1, len(mine) + 1))  # from the first step


def test_a_registered_monitor_can_be_switched_off_and_unknown_sections_are_refused(
    tmp_path, loss_ceiling
):
    cfg = compose_run(tmp_path, [*BASE, "monitor.loss_ceiling.enabled=false"])  # no "+"
    assert "loss_ceiling" not in MonitorSuite(cfg.monitor).monitors
    with pytest.raises(ValueError, match=r"monitor.bogus is not a known setting; allowed: \["):
        compose_run(tmp_path, [*BASE, "+monitor.bogus.enabled=true"])
    with pytest.raises(ValueError, match="'loss_ceiling'"):  # the allowed list follows the registry
        MonitorConfig(bogus={})


def test_a_monitor_needing_a_statistic_nothing_measures_is_refused(loss_ceiling):
    class Needy(LossCeiling):
        needs = ("loss", "qk_entropy")

    register_monitor("needy", LossCeilingConfig, Needy)
    try:
        with pytest.raises(ValueError, match="monitor.needy needs='qk_entropy' is not allowed"):
            MonitorSuite(MonitorConfig())
    finally:
        unregister_monitor("needy")
    assert "needy" not in MONITORS


def test_the_built_in_monitors_declare_what_they_read():
    suite = MonitorSuite(MonitorConfig())
    assert {k: set(m.needs) for k, m in suite.monitors.items()} == {
        "activation": {
            "act_max",
            "norm_overflow",
            "norm_collapsed",
            "norm_nan_rows",
            "norm_rms_max",
            "norm_dim",
            "act_alias",
        },
        "grad_spike": {"grad_norm"},
        "loss_spike": {"loss"},
        "nonfinite": {"loss", "grad_norm", "loss_scale"},
        "loss_scale": {"loss_scale", "scaler_skipped"},
        "attn_logit": {"attn_logit"},
        "attn_entropy": {"attn_entropy"},
        "log_z": {"log_z"},
        "replicas": {"replicas"},
        "curvature": {"opt"},
        "quant": {
            "quant_saturated",
            "quant_underflow",
            "quant_amax_ratio",
            "quant_clipped",
            "quant_edge",
        },
    }


# ---- a remedy -------------------------------------------------------------------------------
LARGE_EPS = 1e-3


@dataclass
class LargeEpsConfig:
    """``rollback.remedy.large_eps``."""

    eps: float = LARGE_EPS
    """Every norm's eps is set to this."""


class LargeEps(Remedy):
    """Every norm's eps to ``rollback.remedy.large_eps.eps``: a module attribute, in no state
    dict, so a resumed run must re-apply it."""

    name = "large_eps"
    config = LargeEpsConfig

    def apply(self, state, cfg):
        n = 0
        for m in state.model.modules():
            if isinstance(m, Norm):
                m.eps, n = cfg.eps, n + 1
        return {"eps": cfg.eps, "norms": n}

    def reapply(self, state, cfg, times):
        self.apply(state, cfg)


@pytest.fixture
def large_eps():
    register_remedy(LargeEps())
    yield
    unregister_remedy("large_eps")


class NormEps(L.Callback):
    """Every norm's eps at the start and at the end of training."""

    def __init__(self):
        self.start: set[float] = set()
        self.end: set[float] = set()

    @staticmethod
    def _eps(pl_module) -> set[float]:
        return {m.eps for m in pl_module.model.modules() if isinstance(m, Norm)}

    def on_train_start(self, trainer, pl_module):
        self.start = self._eps(pl_module)

    def on_train_end(self, trainer, pl_module):
        self.end = self._eps(pl_module)


def test_a_registered_remedy_climbs_the_ladder_and_is_reapplied_on_resume(tmp_path, large_eps):
    import torch

    common = [
        *BASE,
        "fault=nan_loss",
        "fault.step=5",
        "rollback.ladder=[large_eps]",
        "trainer.checkpoint_every_n_steps=3",
    ]
    cut = tmp_path / "cut"
    first = NormEps()
    run(compose_run(cut, [*common, "trainer.stop_at_step=9"]), callbacks=[first])
    (done,) = [e for e in events(cut) if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert done["step"] == 5 and done["extra"]["remedy"] == "large_eps"
    assert done["extra"]["eps"] == LARGE_EPS and done["extra"]["norms"] > 0
    assert first.start == {1e-5} and first.end == {LARGE_EPS}  # applied by the rollback
    ckpt = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["remedies"] == ["large_eps"]

    resumed = NormEps()
    out = run(compose_run(cut, [*common, "resume=auto"]), callbacks=[resumed])
    assert out["model_step"] == 14
    assert resumed.start == {LARGE_EPS}  # re-applied on load: the fault did not fire again
    rollbacks = [e for e in events(cut) if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert len(rollbacks) == 1


def test_the_ladder_follows_the_remedy_registry(tmp_path, large_eps):
    assert list(REMEDIES)[:4] == ["retry", "skip_data", "lower_lr", "fp32_reduction"]
    with pytest.raises(ValueError, match=r"rollback.ladder\[0\]='nope' is not allowed; allowed: "):
        compose_run(tmp_path, [*BASE, "rollback.ladder=[nope]"])
    with pytest.raises(ValueError, match="'large_eps'"):
        compose_run(tmp_path, [*BASE, "rollback.ladder=[nope]"])


@pytest.mark.parametrize("declared", [True, False])
def test_the_probe_measures_what_a_monitor_declares_on_every_step(tmp_path, declared):
    """The attention-logit bound is measured on log steps only, unless a monitor declares
    it among its needs: then on every step (without the declaration the other steps have
    none: a value not measured is absent, never a 0)."""
    seen: list[dict[str, float]] = []

    class AttnWatch(LossCeiling):
        needs = ("attn_logit",) if declared else ("loss",)

        def update(self, stats):
            seen.append(dict(stats.attn_logit))
            return []

    register_monitor("attn_watch", LossCeilingConfig, AttnWatch)
    try:
        over = ["trainer.max_steps=6", "trainer.log_every_n_steps=4"]
        # the built-in attn_logit monitor declares it too: off, so AttnWatch alone decides
        over += ["monitor.attn_logit.enabled=false"]
        run(compose_run(tmp_path, [*BASE, *over]))
    finally:
        unregister_monitor("attn_watch")
    assert len(seen) == 6
    measured = [bool(s) and all(v > 0 for v in s.values()) for s in seen]
    # Lightning's step 4 is logged: the probe measured the bound on the 4th step either way
    assert measured == ([True] * 6 if declared else [False, False, False, True, False, False])
    assert all(s == {} for s, m in zip(seen, measured, strict=True) if not m)
