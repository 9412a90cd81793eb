"""A fault kind added from outside the package: registered by this file, accepted by the
config (Hydra's ``fault.kind``), driven by the real training loop, caught by the monitors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from test_stability import BASE

from stabilize.faults import (
    Fault,
    FaultConfig,
    FaultInjector,
    PointFault,
    fault_config,
    fault_kinds,
    register_fault,
    unregister_fault,
)
from stabilize.train import run
from stabilize.validate import check_positive

from conftest import CONFIGS, compose_run

BUILT_IN = fault_kinds()  # before this file registers any: what the package registers


@dataclass
class ScaleLossConfig(FaultConfig):
    scale: float = 1e6
    """The loss of the step is multiplied by this."""

    def check(self) -> None:
        check_positive("fault.scale", self.scale)


class ScaleLoss(PointFault):
    """The step's loss multiplied by ``fault.scale`` (1e6): finite, so only the gradient-norm
    spike shows it."""

    kind = "scale_loss"
    config = ScaleLossConfig

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cfg.scale if self.fires(step) else loss


@pytest.fixture
def scale_loss():
    register_fault(ScaleLoss)
    yield ScaleLoss
    unregister_fault("scale_loss")


def test_the_built_in_kinds_and_the_hydra_group_name_the_same_faults():
    # (each file's keys and values are its kind's dataclass: tests/test_configs.py)
    for path in sorted((CONFIGS / "fault").glob("*.yaml")):
        assert yaml.safe_load(path.read_text())["kind"] == path.stem
    assert {p.stem for p in (CONFIGS / "fault").glob("*.yaml")} == set(BUILT_IN)
    assert "scale_loss" not in BUILT_IN


def test_a_registered_kind_is_allowed_and_an_unknown_one_lists_it(scale_loss, tmp_path):
    assert fault_kinds() == (*BUILT_IN, "scale_loss")
    assert fault_config(kind="scale_loss") == ScaleLossConfig(kind="scale_loss")
    cfg = compose_run(tmp_path, ["fault.kind=scale_loss", "fault.step=3", "+fault.scale=10"])
    assert (cfg.fault.kind, cfg.fault.step, cfg.fault.scale) == ("scale_loss", 3, 10)
    assert type(cfg.fault) is ScaleLossConfig
    allowed = str([*BUILT_IN, "scale_loss"]).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=rf"fault.kind='bogus' is not allowed; allowed: {allowed}"):
        compose_run(tmp_path, ["fault.kind=bogus"])


def test_a_knob_is_its_kinds_alone(scale_loss, tmp_path):
    keys = r"allowed: \['kind', 'step', 'rank', 'persistent', 'enabled', 'scale'\]"
    with pytest.raises(
        ValueError, match=rf"fault.factor=7.0 is not a setting of fault.kind='scale_loss'; {keys}"
    ):
        fault_config(kind="scale_loss", factor=7.0)
    with pytest.raises(ValueError, match=r"fault.scale=-1 is not allowed; must be a positive"):
        fault_config(kind="scale_loss", scale=-1)
    # a file of the group holds its kind's knobs only: another kind's is added with +
    drift_knob = r"fault.layer=3 is not a setting of fault.kind='grad_spike'; allowed: \["
    with pytest.raises(ValueError, match=drift_knob):
        compose_run(tmp_path, ["fault=grad_spike", "+fault.layer=3"])
    assert compose_run(tmp_path, ["fault=grad_spike", "fault.factor=7"]).fault.factor == 7.0
    # the config of a kind with knobs is its own dataclass, never the common one
    with pytest.raises(ValueError, match=r"fault.kind='scale_loss' is not allowed in a FaultConf"):
        FaultConfig(kind="scale_loss")


def test_unregistering_removes_the_kind_again():
    register_fault(ScaleLoss)
    register_fault(ScaleLoss)  # the same class again: a no-op
    unregister_fault("scale_loss")
    assert fault_kinds() == BUILT_IN
    with pytest.raises(ValueError, match=r"fault.kind='scale_loss' is not allowed; allowed: \["):
        fault_config(kind="scale_loss")
    with pytest.raises(ValueError, match="fault.kind='scale_loss' is not allowed"):
        unregister_fault("scale_loss")


def test_a_kind_name_is_taken_once_and_must_be_a_name():
    class Impostor(PointFault):
        kind = "nan_loss"

    class Nameless(Fault):
        pass

    with pytest.raises(ValueError, match=r"fault.kind='nan_loss' is already registered by "):
        register_fault(Impostor)
    with pytest.raises(ValueError, match=r"Nameless.kind='' is not allowed"):
        register_fault(Nameless)
    assert fault_kinds() == BUILT_IN


def test_the_injector_drives_the_new_kind_at_its_step_once(scale_loss):
    inj = FaultInjector(fault_config(kind="scale_loss", step=3))
    assert isinstance(inj.fault, ScaleLoss)
    one = torch.tensor(2.0)
    assert [float(inj.on_loss(s, one)) for s in (1, 2, 3, 3, 4)] == [2.0, 2.0, 2e6, 2.0, 2.0]
    assert inj.happened and inj.fired == {3}
    inj.on_rollback(inj.snapshot_state())
    assert inj.disabled  # a transient fault that happened is over after a rollback
    assert inj.state_dict() == {
        "drift_factor": 1.0,
        "drift_start": None,
        "fired": [3],
        "disabled": True,
    }


def test_the_new_kind_fires_in_training_and_is_rolled_back(scale_loss, tmp_path):
    # the fault and rollback tests' tiny run: grad_spike rolls back, loss_spike is off (the
    # gradient norm alone must catch it), max_steps=14
    overrides = [*BASE, "fault.kind=scale_loss", "fault.step=9"]
    out = run(compose_run(tmp_path, overrides))
    lines = (Path(tmp_path) / "events.jsonl").read_text().splitlines()
    rollbacks = [e for e in map(json.loads, lines) if e["kind"] == "rollback"]
    # one verdict, at the fault's step, by the gradient-norm spike monitor; then the restore
    assert [(e["monitor"], e["step"]) for e in rollbacks] == [("grad_spike", 9), ("rollback", 9)]
    restore = rollbacks[1]["extra"]
    # the replay is clean (the fault fired once): transient, retried
    assert restore["restored_step"] <= 8 and restore["remedy"] == "retry"
    assert out["model_step"] == 14  # the transient fault did not fire again on the replay
