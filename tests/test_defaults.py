"""Defaults once (issue 35): a component built from its config dataclass's defaults is the one a
run builds from the composed config (configs/train.yaml composed as the CLI does), for every
monitor (the forecaster and the spike detectors among them), every fault kind with knobs and
every remedy with settings; the group options with nothing of their own compose to their
dataclass's defaults."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import pytest

from stabilize.data import DataConfig
from stabilize.faults import FaultConfig, fault_class, fault_config
from stabilize.faults.config import FAULTS
from stabilize.model import GPTConfig
from stabilize.monitors import (
    MONITORS,
    ActivationConfig,
    ActivationMonitor,
    GradSpikeConfig,
    LossScaleMonitor,
    LossSpikeConfig,
    SpikeDetector,
)
from stabilize.monitors.activations import resolve_line
from stabilize.monitors.forecast import ForecastConfig, LineForecaster
from stabilize.monitors.logits import AttnEntropyMonitor, AttnLogitMonitor, LogZMonitor
from stabilize.norms import NormConfig
from stabilize.quant.config import QuantConfig
from stabilize.rollback import REMEDIES
from stabilize.run.config import (
    AuditConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    TrainerConfig,
)

from conftest import compose_run


def state(obj: Any) -> Any:
    """An object's attributes, recursively, as plain comparable values (its type included)."""
    if isinstance(obj, dict):
        return {k: state(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [state(v) for v in obj]
    if isinstance(obj, deque):
        return ("deque", obj.maxlen, [state(v) for v in obj])
    if isinstance(obj, set):
        return ("set", sorted(obj))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__qualname__, state(vars(obj)))
    return obj


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> RunConfig:
    """What ``stabilize-train`` with no arguments builds."""
    return compose_run(tmp_path_factory.mktemp("defaults"), [])


def test_every_monitor_built_from_its_defaults_is_the_one_a_run_builds(users):
    c = users
    assert list(c.monitor.sections) == list(MONITORS)
    for name, entry in MONITORS.items():
        default = entry.config()
        if name == "activation":  # the run fills in its line and dtype (resolve_line)
            default = resolve_line(default, c.precision.name, c.model.norm.reduction_dtype)
        assert c.monitor.sections[name] == default, name
        ran, built = entry.build(name, c.monitor.sections[name]), entry.build(name, default)
        assert state(ran) == state(built), name


def test_built_with_no_arguments_is_built_from_the_composed_config(users, tmp_path):
    c = users.monitor
    for cls, section in ((LossScaleMonitor, c.loss_scale), (AttnLogitMonitor, c.attn_logit),
                         (AttnEntropyMonitor, c.attn_entropy), (LogZMonitor, c.log_z)):  # fmt: skip
        assert state(cls()) == state(cls(section)), cls.__name__
    # the activation monitor: what a run fills in (the line, the activation dtype) aside
    fp16 = compose_run(tmp_path, ["experiment=nan_repro"]).monitor.activation
    assert dataclasses.replace(fp16, line="auto", activation_dtype="fp32") == ActivationConfig()
    assert state(ActivationMonitor().forecaster) == state(LineForecaster(fp16.forecast))
    assert vars(ActivationMonitor()).keys() == vars(ActivationMonitor(fp16)).keys()
    same = {"c", "meaning"}  # meaning: the same words for fp16_square, whatever the dtype
    assert {k: state(v) for k, v in vars(ActivationMonitor()).items() if k not in same} == {
        k: state(v) for k, v in vars(ActivationMonitor(fp16)).items() if k not in same
    }
    assert ActivationMonitor().meaning == ActivationMonitor(fp16).meaning


def test_the_forecaster_and_the_spike_detectors_are_the_ones_users_run(users):
    c = users.monitor
    assert state(LineForecaster(c.activation.forecast)) == state(LineForecaster(ForecastConfig()))
    for section, cls in ((c.grad_spike, GradSpikeConfig), (c.loss_spike, LossSpikeConfig)):
        assert section == cls()
        assert state(SpikeDetector(section)) == state(SpikeDetector(cls()))
    # the settled disagreements: users run 50/8.0 and 8/8.0, the loss's sigma trend-robust
    grad, loss = SpikeDetector(c.grad_spike), SpikeDetector(c.loss_spike)
    assert (grad.warmup, grad.threshold, grad.kind, grad.trend_robust) == (50, 8.0, "warn", False)
    assert (loss.warmup, loss.threshold, loss.kind, loss.trend_robust) == (8, 8.0, "rollback", True)
    assert ActivationMonitor(c.activation).slow_steps == 6.0


@pytest.mark.parametrize("kind", [k for k in FAULTS if FAULTS.config(k) is not FaultConfig])
def test_every_fault_kind_with_knobs_is_built_as_its_dataclass_says(kind, tmp_path):
    ran = compose_run(tmp_path, [f"fault={kind}"]).fault
    assert ran == fault_config(kind=kind)
    cls = fault_class(kind)
    assert state(cls(ran)) == state(cls(fault_config(kind=kind)))


def test_every_remedy_with_settings_runs_its_dataclass_defaults(users):
    assert list(users.rollback.remedy) == REMEDIES.configured()
    for name, section in users.rollback.remedy.items():
        assert section == REMEDIES.config(name)(), name  # what apply() and reapply() receive


def test_the_bare_group_options_compose_to_their_dataclass_defaults(tmp_path):
    """``~experiment``: every group's default option alone. What differs is what the option
    is for (the tiny preset's name) and what the run resolves (the activation line)."""
    c = compose_run(tmp_path, ["~experiment"])
    assert c.model == GPTConfig(name="tiny") and c.model.norm == NormConfig()
    assert c.data == DataConfig() and c.audit == AuditConfig()
    assert (c.optim, c.precision, c.trainer) == (OptimConfig(), PrecisionConfig(), TrainerConfig())
    assert c.logger == LoggerConfig()
    top = {f.name for f in dataclasses.fields(RunConfig)} - {"run_dir"}
    assert c.quant == QuantConfig()
    for key in top - {"model", "data", "optim", "precision", "trainer", "logger", "monitor",
                      "rollback", "fault", "audit", "quant"}:  # fmt: skip
        assert getattr(c, key) == getattr(RunConfig, key), key
