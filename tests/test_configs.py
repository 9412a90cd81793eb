"""The config files describe exactly what the dataclasses build."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from stabilize.model import GPTConfig
from stabilize.model.config import PRESETS
from stabilize.norms import NORM_TYPES, NormConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load(path):
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_group_matches_presets(name):
    assert GPTConfig(**load(CONFIGS / "model" / f"{name}.yaml")) == GPTConfig.preset(name)


def test_every_preset_has_a_config_file_and_back():
    assert {p.stem for p in (CONFIGS / "model").glob("*.yaml")} == set(PRESETS)
    assert {p.stem for p in (CONFIGS / "norm").glob("*.yaml")} >= set(NORM_TYPES)


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_norm_group_lists_every_field_with_defaults(kind):
    values = load(CONFIGS / "norm" / f"{kind}.yaml")
    assert set(values) == set(NormConfig.__dataclass_fields__)
    assert NormConfig(**values) == NormConfig(type=kind)
