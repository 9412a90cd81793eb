"""docs/ARCHITECTURE.md's "Where to add..." table, tried for real: a norm type, a monitor, a
remedy with a knob and a fault kind with a knob, each written here, outside the package,
touching only what the table names (a class, its config dataclass, one registration), then
composed into a real Hydra config by name and trained by a real Trainer, cut and resumed.

The four together: the fault multiplies one step's loss by its knob; the monitor rolls the
run back when the loss passes its line; the remedy multiplies every norm's eps by its knob
at each application (a module attribute, in no state dict: its reapply compounds it as
many times as the run applied it); the norm type is what every norm of the model runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from test_registries import NormEps
from test_stability import BASE, events

from stabilize.faults import FaultConfig, PointFault, register_fault, unregister_fault
from stabilize.monitors import ROLLBACK, Event, register_monitor, unregister_monitor
from stabilize.norms import (
    Norm,
    NormConfig,
    NormType,
    build_norm,
    register_norm,
    unregister_norm,
)
from stabilize.rollback import Remedy, reapply_remedies, register_remedy, unregister_remedy
from stabilize.train import run
from stabilize.validate import check_positive

from conftest import compose_run


# ---- a norm type: a NormType subclass, @register_norm ---------------------------------------
class MeanAbsNorm(NormType):
    """x / (mean |x| + eps): the L1 sibling of RMSNorm; gamma [D]."""

    name = "test_meanabs"

    def normalize(self, x, eps):
        stat = x.abs().sum(-1, keepdim=True) / x.shape[-1] + eps  # [..., 1], in x's dtype
        return x / stat, stat

    def reference64(self, x, eps):
        return x / (x.abs().mean(-1, keepdim=True) + eps)

    def mean_square(self, stat, dim):
        return stat * stat


# ---- a monitor: a config dataclass with `enabled`, a class, register_monitor -----------------
@dataclass
class LossLineConfig:
    enabled: bool = True
    threshold: float = 1e3
    """Roll back when the step's loss is above this."""


class LossLine:
    needs = ("loss",)

    def __init__(self, name: str, cfg: LossLineConfig):
        self.name, self.threshold = name, cfg.threshold

    def update(self, stats):
        if stats.loss <= self.threshold:
            return []
        message = f"loss {stats.loss:.3g} above {self.threshold:g}"
        return [Event(ROLLBACK, self.name, stats.step, message, value=stats.loss)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ---- a remedy with a knob: a Remedy subclass with its config, register_remedy ----------------
@dataclass
class EpsUpConfig:
    factor: float = 10.0
    """Every norm's eps is multiplied by this, at each application."""

    def __post_init__(self):
        check_positive("rollback.remedy.eps_up.factor", self.factor)


class EpsUp(Remedy):
    name = "eps_up"
    config = EpsUpConfig

    def apply(self, state, cfg):
        for m in state.model.modules():
            if isinstance(m, Norm):
                m.eps *= cfg.factor
        return {"eps_factor": cfg.factor}

    def reapply(self, state, cfg, times):
        for m in state.model.modules():
            if isinstance(m, Norm):
                m.eps *= cfg.factor**times


# ---- a fault kind with a knob: a PointFault, its config dataclass, @register_fault -----------
@dataclass
class LossBlowupConfig(FaultConfig):
    scale: float = 1e4
    """The step's loss is multiplied by this."""


class LossBlowup(PointFault):
    kind = "loss_blowup"
    config = LossBlowupConfig

    def on_loss(self, step, loss):
        return loss * self.cfg.scale if self.fires(step) else loss


@pytest.fixture
def added():
    register_norm(MeanAbsNorm)
    register_monitor("loss_line", LossLineConfig, LossLine)
    register_remedy(EpsUp())
    register_fault(LossBlowup)
    yield
    unregister_fault("loss_blowup")
    unregister_remedy("eps_up")
    unregister_monitor("loss_line")
    unregister_norm("test_meanabs")


def test_the_four_rows_of_the_table_train_together_and_resume(tmp_path, added):
    common = [
        *BASE,
        "monitor.grad_spike.enabled=false",  # the new monitor alone must see the fault
        "norm.type=test_meanabs",
        "norm.backend=explicit",
        # each one's settings are composed with its defaults, as a built-in one's: no "+"
        "fault=loss_blowup",  # a kind with no configs/fault/<kind>.yaml: its defaults
        "fault.step=5",
        "fault.scale=1e5",
        "monitor.loss_line.threshold=100",
        "rollback.ladder=[eps_up]",
        "rollback.remedy.eps_up.factor=4",
        "trainer.checkpoint_every_n_steps=3",
    ]
    cfg = compose_run(tmp_path, common)
    assert (cfg.fault.scale, cfg.monitor.loss_line.threshold) == (1e5, 100)
    assert cfg.rollback.remedy.eps_up.factor == 4 and cfg.model.norm.type == "test_meanabs"
    other_kind = r"fault.scale=100000.0 is not a setting of fault.kind='nan_loss'"
    with pytest.raises(ValueError, match=other_kind):
        compose_run(tmp_path, [*common, "fault.kind=nan_loss"])

    first = NormEps()
    run(compose_run(tmp_path, [*common, "trainer.stop_at_step=9"]), callbacks=[first])
    evs = events(tmp_path)
    verdicts = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "loss_line"]
    (done,) = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert [e["step"] for e in verdicts][:1] == [5] and done["step"] == 5
    assert done["extra"]["remedy"] == "eps_up" and done["extra"]["eps_factor"] == 4
    assert first.start == {1e-5} and [*first.end] == [pytest.approx(4e-5)]
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["remedies"] == ["eps_up"]

    resumed = NormEps()
    out = run(compose_run(tmp_path, [*common, "resume=auto"]), callbacks=[resumed])
    assert out["model_step"] == 14 and math.isfinite(out["metrics"]["train/loss"])
    assert [*resumed.start] == [pytest.approx(4e-5)]  # reapplied once: it was applied once
    assert len([e for e in events(tmp_path) if e["monitor"] == "rollback"]) == 1


def test_reapply_is_told_how_many_times_each_remedy_was_applied(added):
    class State:
        model = torch.nn.Sequential(build_norm(8, NormConfig(type="test_meanabs")))

    seen: list[tuple[str, object, int]] = []

    class Counted(Remedy):
        name = "counted"

        def reapply(self, state, cfg, times):
            seen.append((self.name, cfg, times))

    register_remedy(Counted())
    try:
        cfgs = {"eps_up": EpsUpConfig(factor=2.0)}
        reapply_remedies(State(), ["counted", "eps_up", "counted", "eps_up", "counted"], cfgs)
    finally:
        unregister_remedy("counted")
    assert seen == [("counted", None, 3)]  # once per remedy, with its count, no config
    assert State.model[0].eps == pytest.approx(1e-5 * 2.0**2)  # compounded twice, once


def test_the_added_settings_need_no_plus_and_leave_with_their_registration(tmp_path):
    """Registered, a monitor's, a remedy's and a fault kind's settings are composed with their
    defaults as a built-in one's are (``fault=<kind>`` too: the kind has no option file of its
    own); unregistered, they are gone from the composed config again."""
    register_monitor("loss_line", LossLineConfig, LossLine)
    register_remedy(EpsUp())
    register_fault(LossBlowup)
    try:
        cfg = compose_run(tmp_path, ["fault=loss_blowup", "monitor.loss_line.enabled=false"])
        assert cfg.fault == LossBlowupConfig(kind="loss_blowup")
        assert cfg.monitor.loss_line == LossLineConfig(enabled=False)
        assert cfg.rollback.remedy.eps_up == EpsUpConfig()
        # fault.kind alone keeps the option's keys: another kind's knob is appended, with +
        cfg = compose_run(tmp_path, ["fault.kind=loss_blowup", "+fault.scale=3"])
        assert cfg.fault == LossBlowupConfig(kind="loss_blowup", scale=3.0)
    finally:
        unregister_fault("loss_blowup")
        unregister_remedy("eps_up")
        unregister_monitor("loss_line")
    cfg = compose_run(tmp_path, [])
    assert "loss_line" not in cfg.monitor.sections and "eps_up" not in cfg.rollback.remedy
    with pytest.raises(Exception, match=r"monitor\.loss_line\.threshold"):
        compose_run(tmp_path, ["monitor.loss_line.threshold=5"])
