"""The config files and the dataclasses: the dataclasses are the one source of every default
(stabilize/config_store.py puts them under every option file), each option file composes to
exactly what its dataclass builds for that option, and no file repeats a default: each holds
only what differs from its dataclass (and the key that names the option), so a second copy
of a default cannot come back."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from stabilize.config_store import store
from stabilize.data import DataConfig
from stabilize.faults import fault_config
from stabilize.faults.config import FAULTS
from stabilize.model import GPTConfig
from stabilize.model.config import PRESETS
from stabilize.monitors import MonitorConfig
from stabilize.norms import NORM_TYPES, NormConfig
from stabilize.quant.config import QuantConfig
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
    """A dataclass's defaults, field by field, without building it."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def _model(option):
    # model=hf: the default sizes (the tiny preset's) as a Hugging Face architecture
    cfg = GPTConfig(name="hf", hf={}) if option == "hf" else GPTConfig.preset(option)
    return {k: v for k, v in asdict(cfg).items() if k != "norm"}


def _rollback(enabled: bool) -> dict:
    d = asdict(RollbackConfig(enabled=enabled))
    return {**d, "remedy": dict(d["remedy"])}


# group -> option -> what its file must compose to; each value is built from the dataclass.
EXPECTED = {
    "model": _model,  # norm is its own group
    "norm": lambda o: asdict(NormConfig(type=o)),
    "precision": lambda o: asdict(PrecisionConfig(name=o)),
    # hub and local must be told the dataset: their defaults are refused with that source
    "data": lambda o: {**defaults(DataConfig), "source": o},
    "optim": lambda o: asdict(OptimConfig()),
    "trainer": lambda o: asdict(TrainerConfig()),
    "logger": lambda o: {
        **asdict(LoggerConfig()),
        **({"wandb": False, "mode": "disabled"} if o == "none" else {}),
    },
    "monitor": lambda o: MonitorConfig(enabled=o != "off").to_dict(),
    "rollback": lambda o: _rollback(enabled=o != "off"),
    "fault": lambda o: asdict(fault_config(kind=o)),
    "quant": lambda o: asdict(QuantConfig(name=o)),
}
# Not one dataclass's options: variants of the whole run (``_global_``), each composed and
# run for a few steps elsewhere (tests/test_recipe.py, tests/test_scenario.py); their keys
# are a recipe's choices, which may pin a default on purpose.
WHOLE_RUN = {"experiment", "arm"}
NOT_A_RUN = {"map"}  # stabilize-map's specs (tests/test_map.py), not a group of a run
OPTIONS = sorted(
    (p.parent.name, p.stem)
    for p in CONFIGS.glob("*/*.yaml")
    if p.parent.name not in WHOLE_RUN | NOT_A_RUN
)
# The key that says which option a file is; it may equal the default (norm=layernorm).
NAMES = {"model": "name", "norm": "type", "precision": "name", "data": "source", "fault": "kind",
         "quant": "name"}  # fmt: skip


def composed(group: str | None, option: str | None) -> dict:
    over = ["~experiment", "arm=none"] + ([f"{group}={option}"] if group else [])
    store()  # as every composer does (stabilize/train.py on import)
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=over)
    values = OmegaConf.to_container(cfg, resolve=False)
    return values if group is None else OmegaConf.to_container(cfg[group], resolve=True)


@pytest.mark.parametrize(("group", "option"), [*OPTIONS, (None, "train.yaml")])
def test_every_option_file_composes_to_what_its_dataclass_builds(group, option):
    if group is None:  # the primary config's own keys: RunConfig's (run_dir is Hydra's dir)
        values = composed(None, None)
        top = {f.name for f in dataclasses.fields(RunConfig)} - {"run_dir", *EXPECTED}
        expect = {k: v for k, v in defaults(RunConfig).items() if k in top}
        expect["audit"] = asdict(AuditConfig())
        assert {k: values[k] for k in expect} == expect
        assert values["run_dir"] == "${hydra:runtime.output_dir}"
        return
    assert group in EXPECTED, f"configs/{group}/ is a group no test knows: add it to EXPECTED"
    assert composed(group, option) == EXPECTED[group](option)


DATACLASS = {"model": GPTConfig, "norm": NormConfig, "precision": PrecisionConfig,
             "data": DataConfig, "optim": OptimConfig, "trainer": TrainerConfig,
             "logger": LoggerConfig, "quant": QuantConfig}  # fmt: skip


def own_default(group: str | None, values: dict) -> dict:
    """What the dataclass behind a file gives each key the file may hold."""
    if group is None:  # train.yaml: RunConfig's own keys, audit a mapping
        return {**defaults(RunConfig), "audit": asdict(AuditConfig())}
    if group == "fault":  # the dataclass of the file's kind (its knobs only)
        return defaults(FAULTS.config(values.get("kind", "none")))
    if group in ("monitor", "rollback"):  # a section per registered monitor / remedy
        return EXPECTED[group]("default")
    return defaults(DATACLASS[group])


def repeats(values: dict, default: dict, where: str, name: str | None) -> list[str]:
    """The keys of ``values`` that are no setting, or repeat their default (a section, a
    mapping of settings, is read key by key; ``name``, the option's own name, may)."""
    out = []
    for key, value in values.items():
        path = f"{where}.{key}"
        if key not in default:
            out.append(f"{path}: not a setting (allowed: {list(default)})")
        elif isinstance(default[key], dict) and default[key] and isinstance(value, dict):
            out += repeats(value, default[key], path, None)
        elif value == default[key] and key != name and not isinstance(value, dict):
            out.append(f"{path}: {value!r} is its dataclass's default")
    return out


@pytest.mark.parametrize(("group", "option"), [*OPTIONS, (None, "train")])
def test_no_file_repeats_a_default_and_every_key_is_a_setting(group, option):
    path = CONFIGS / (f"{group}/{option}.yaml" if group else f"{option}.yaml")
    values: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    listed = values.pop("defaults", [])
    if group is None:
        values.pop("hydra")
        assert listed[:2] == ["base_run", "_self_"]
    else:  # the dataclass's defaults first (or another option of the group), then its own
        assert (
            listed in ([f"/base_{group}@_here_", "_self_"], ["default", "_self_"])
            or (group == "fault" and listed == [f"/base_fault_{values['kind']}@_here_", "_self_"])
            or (option == "hf" and listed == ["/base_model@_here_", "/base_model_hf@hf", "_self_"])
        ), listed
    bad = repeats(values, own_default(group, values), group or "train", NAMES.get(group))
    assert not bad, f"{path.relative_to(CONFIGS.parent)}: " + "; ".join(bad)


def test_every_preset_and_registered_name_has_a_config_file_and_back():
    assert {p.stem for p in (CONFIGS / "model").glob("*.yaml")} == {*PRESETS, "hf"}
    assert {p.stem for p in (CONFIGS / "norm").glob("*.yaml")} >= set(NORM_TYPES)


def test_errors_name_the_key_that_was_set(tmp_path):
    # each spike section has its own dataclass: the error names it, not a shared "spike"
    for section in ("loss_spike", "grad_spike"):
        with pytest.raises(ValueError, match=rf"monitor\.{section}\.threshold=-1 is not allowed"):
            compose_run(tmp_path, [f"monitor.{section}.threshold=-1"])
    # every dataclass field is a key of the composed config: no "use +" for a real setting
    cfg = compose_run(tmp_path, ["monitor.activation.forecast.damped=false"])
    assert cfg.monitor.activation.forecast.damped is False
    cfg = compose_run(tmp_path, ["rollback.remedy.skip_data.batches=7"])
    assert cfg.rollback.remedy.skip_data.batches == 7
    with pytest.raises(ValueError, match=r"rollback\.remedy\.lower_lr\.factor=2\.0 is not allowed"):
        compose_run(tmp_path, ["rollback.remedy.lower_lr.factor=2.0"])
    with pytest.raises(ValueError, match=r"rollback\.remedy\.retry is not a known setting; all"):
        compose_run(tmp_path, ["+rollback.remedy.retry.times=2"])
