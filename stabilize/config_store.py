"""The dataclasses' defaults as Hydra configs: every option file of configs/ starts from its
dataclass, so a YAML holds only what differs from it (issue 35, "defaults once").

Each node is a plain mapping of a dataclass's defaults, not a typed structured config: the
dataclasses check every value themselves (the key, the value and the allowed values, rule 3),
and OmegaConf refuses their unions other than Optional (``devices: int | str``). The nodes
sit at the top level of Hydra's ConfigStore, outside the groups, so ``--help`` and Hydra's
"available options" list only the real options (``base_run``: train.yaml's own keys;
``base_<group>``: a group's; ``base_fault_<kind>``: one per fault kind). An option file
puts its base in its own package, then its own keys::

    defaults:
      - /base_model@_here_
      - _self_

The nodes built from a registry (``monitor``: one section per registered monitor;
``rollback.remedy``: one per remedy with settings; one ``base_fault_<kind>`` per kind) are
stored again whenever that registry changes (``Registry.watch``), so a monitor, remedy or
fault kind registered from outside the package is composed with its defaults as a built-in
one is, and its settings are overridden with no ``+``. A fault kind without a
``configs/fault/<kind>.yaml`` gets a ``fault=<kind>`` option of its defaults.

Every composer calls ``store()`` first: stabilize/train.py on import (the CLI, every torchrun
rank, the tests' compose_run), stabilize-plan, stabilize-map's recipe check. Hydra hands the
ConfigStore to its joblib and submitit workers with the rest of its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from hydra.core.config_store import ConfigStore

from stabilize.data.config import DataConfig
from stabilize.faults.config import FAULTS
from stabilize.model.config import GPTConfig
from stabilize.monitors import MONITORS, MonitorConfig
from stabilize.norms.config import NormConfig
from stabilize.paths import config_dir
from stabilize.rollback import REMEDIES, RollbackConfig
from stabilize.run.config import (
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    RunConfig,
    TrainerConfig,
)

# RunConfig's sections that are Hydra groups (configs/<group>/), with their dataclass where
# one dataclass's defaults are the whole group's; ``audit`` is not a group (train.yaml's own)
GROUPS: dict[str, type | None] = {
    "model": GPTConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "precision": PrecisionConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "monitor": None,  # one section per registered monitor
    "rollback": None,  # and one per remedy with settings
    "fault": None,  # one dataclass per kind
}


def defaults(cls: type, skip: Collection[str] = ()) -> dict[str, Any]:
    """A dataclass's defaults, field by field (but ``skip``), as plain values (a nested
    dataclass as a mapping; a field with no default as Hydra's mandatory ``???``), without
    building it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = "???"
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def fault_node(kind: str) -> dict[str, Any]:
    """``fault=<kind>``'s defaults: its dataclass's, with its kind."""
    return {**defaults(FAULTS.config(kind)), "kind": kind}


def nodes() -> dict[str, dict[str, Any]]:
    """Every base node, by name."""
    out = {"base_run": defaults(RunConfig, skip=GROUPS), "base_norm": defaults(NormConfig)}
    for group, cls in GROUPS.items():
        if cls is not None:
            out[f"base_{group}"] = defaults(cls)
    del out["base_model"]["norm"]  # the norm is its own group
    out["base_monitor"] = MonitorConfig().to_dict()
    remedy = {name: defaults(REMEDIES.config(name)) for name in REMEDIES.configured()}
    out["base_rollback"] = {**defaults(RollbackConfig), "remedy": remedy}
    for kind in FAULTS:
        out[f"base_fault_{kind}"] = fault_node(kind)
    return out


def store() -> None:
    """Store every base node (again: the registries may have changed), and follow the
    registries from now on."""
    cs = ConfigStore.instance()
    for name, node in nodes().items():
        cs.store(name=name, node=node)
    for kind in FAULTS:  # a kind with no option file of its own (one registered outside)
        if not (config_dir() / "fault" / f"{kind}.yaml").is_file():
            cs.store(group="fault", name=kind, node=fault_node(kind))
    for registry in (MONITORS, REMEDIES, FAULTS):
        registry.watch(store)
