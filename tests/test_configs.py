"""The config files describe exactly what the dataclasses build: the dataclasses are the one
source of every default, and each option file of each group lists every key with the
dataclass's value, apart from what that option is for (its name, a preset, ``enabled``)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from stabilize.data import DataConfig
from stabilize.faults import fault_config
from stabilize.model import GPTConfig
from stabilize.model.config import PRESETS
from stabilize.monitors import MonitorConfig
from stabilize.norms import NORM_TYPES, NormConfig
from stabilize.rollback import RollbackConfig
from stabilize.run.config import (
    AuditConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    TrainerConfig,
)

from conftest import compose_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def defaults(cls) -> dict:
    """A dataclass's defaults, field by field, without building it (its checks would refuse
    the mandatory ``???`` of a group option that must be given)."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def _model(option):
    return {k: v for k, v in asdict(GPTConfig.preset(option)).items() if k != "norm"}


# group -> option -> what its file must compose to; each value is built from the dataclass.
EXPECTED = {
    "model": _model,  # norm is its own group
    "norm": lambda o: asdict(NormConfig(type=o)),
    "precision": lambda o: asdict(PrecisionConfig(name=o)),
    # hub and local must be told the dataset: Hydra's mandatory ``???``
    "data": lambda o: {
        **defaults(DataConfig),
        "source": o,
        **{"hub": {"name": "???"}, "local": {"paths": "???"}}.get(o, {}),
    },
    "optim": lambda o: asdict(OptimConfig()),
    "trainer": lambda o: asdict(TrainerConfig()),
    "logger": lambda o: {
        **asdict(LoggerConfig()),
        **({"wandb": False, "mode": "disabled"} if o == "none" else {}),
    },
    "monitor": lambda o: MonitorConfig(enabled=o != "off").to_dict(),
    "rollback": lambda o: asdict(RollbackConfig(enabled=o != "off")),
    "fault": lambda o: asdict(fault_config(kind=o)),
}
# Not one dataclass's options: variants of the whole run (``_global_``), each composed and
# run for a few steps elsewhere (tests/test_recipe.py, tests/test_scenario.py).
WHOLE_RUN = {"experiment", "arm"}
NOT_A_RUN = {"map"}  # stabilize-map's specs (tests/test_map.py), not a group of a run
OPTIONS = sorted(
    (p.parent.name, p.stem)
    for p in CONFIGS.glob("*/*.yaml")
    if p.parent.name not in WHOLE_RUN | NOT_A_RUN
)


def composed(group: str | None, option: str | None) -> dict:
    over = ["~experiment", "arm=none"] + ([f"{group}={option}"] if group else [])
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=over)
    values = OmegaConf.to_container(cfg, resolve=False)
    return values if group is None else OmegaConf.to_container(cfg[group], resolve=True)


@pytest.mark.parametrize(("group", "option"), [*OPTIONS, (None, "train.yaml")])
def test_every_option_file_lists_every_key_with_the_dataclass_default(group, option):
    if group is None:  # the primary config's own keys: RunConfig's (run_dir is Hydra's dir)
        values = composed(None, None)
        top = {f.name for f in dataclasses.fields(RunConfig)} - {"run_dir", *EXPECTED}
        expect = {k: v for k, v in defaults(RunConfig).items() if k in top}
        expect["audit"] = asdict(AuditConfig())
        assert {k: values[k] for k in expect} == expect
        return
    assert group in EXPECTED, f"configs/{group}/ is a group no test knows: add it to EXPECTED"
    assert composed(group, option) == EXPECTED[group](option)


def test_every_preset_and_registered_name_has_a_config_file_and_back():
    assert {p.stem for p in (CONFIGS / "model").glob("*.yaml")} == set(PRESETS)
    assert {p.stem for p in (CONFIGS / "norm").glob("*.yaml")} >= set(NORM_TYPES)


def test_errors_name_the_key_that_was_set(tmp_path):
    # each spike section has its own dataclass: the error names it, not a shared "spike"
    for section in ("loss_spike", "grad_spike"):
        with pytest.raises(ValueError, match=rf"monitor\.{section}\.threshold=-1 is not allowed"):
            compose_run(tmp_path, [f"monitor.{section}.threshold=-1"])
    # every dataclass field is a key of its file: no "use +" for a real setting
    cfg = compose_run(tmp_path, ["monitor.activation.forecast_damped=false"])
    assert cfg.monitor.activation.forecast_damped is False
    cfg = compose_run(tmp_path, ["rollback.remedy.skip_data.batches=7"])
    assert cfg.rollback.remedy.skip_data.batches == 7
    with pytest.raises(ValueError, match=r"rollback\.remedy\.lower_lr\.factor=2\.0 is not allowed"):
        compose_run(tmp_path, ["rollback.remedy.lower_lr.factor=2.0"])
    with pytest.raises(ValueError, match=r"rollback\.remedy\.retry is not a known setting; all"):
        compose_run(tmp_path, ["+rollback.remedy.retry.times=2"])
