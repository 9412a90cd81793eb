"""The dataclasses' defaults as Hydra configs: every option file of configs/ starts from its
dataclass, so a YAML holds only what differs from it ("defaults once").

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

Every composer calls ``store()`` first: stabilize/train.py on import and in ``main`` (the
CLI, every torchrun rank, the tests' compose_run), stabilize-plan, stabilize-map's recipe
check. Hydra hands the ConfigStore to its joblib and submitit workers with the rest of its
state.

The dataclasses' modules load torch and the data stack, which ``stabilize-train --help`` and
Hydra's own errors never needed (tests/test_startup.py). So the nodes are also kept in a
cache file keyed by a hash of the package's source (``<cache dir>/config-nodes/``, the
token cache's root): a process whose registries are not loaded yet reads them from there,
and builds them (and writes the file) only when the source changed. Once a registry changes
(a built-in or an outside name registered), the next ``store()`` builds them from the live
registries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from stabilize.paths import config_dir, default_cache_dir
from stabilize.registry import on_change

# RunConfig's sections that are Hydra groups (configs/<group>/); ``audit`` is not a group
# (train.yaml's own). Each group's dataclass is named in ``nodes()``, where it is imported.
GROUPS = ("model", "data", "optim", "precision", "trainer", "logger", "monitor", "rollback",
          "fault", "quant")  # fmt: skip


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


def nodes() -> dict[str, dict[str, Any]]:
    """Every base node, by name, built from the dataclasses and the live registries."""
    from stabilize.data.config import DataConfig
    from stabilize.faults.config import FAULTS
    from stabilize.model.config import GPTConfig, HFConfig
    from stabilize.monitors import MonitorConfig
    from stabilize.norms.config import NormConfig
    from stabilize.quant.config import QuantConfig
    from stabilize.rollback import REMEDIES, RollbackConfig
    from stabilize.run.config import (
        LoggerConfig,
        OptimConfig,
        PrecisionConfig,
        RunConfig,
        TrainerConfig,
    )

    classes = {"model": GPTConfig, "data": DataConfig, "optim": OptimConfig,
               "precision": PrecisionConfig, "trainer": TrainerConfig,
               "logger": LoggerConfig, "quant": QuantConfig}  # fmt: skip
    out = {"base_run": defaults(RunConfig, skip=GROUPS), "base_norm": defaults(NormConfig)}
    for group, cls in classes.items():
        out[f"base_{group}"] = defaults(cls)
    del out["base_model"]["norm"]  # the norm is its own group
    out["base_model_hf"] = defaults(HFConfig)  # model=hf's section (configs/model/hf.yaml)
    out["base_monitor"] = MonitorConfig().to_dict()
    remedy = {name: defaults(REMEDIES.config(name)) for name in REMEDIES.configured()}
    out["base_rollback"] = {**defaults(RollbackConfig), "remedy": remedy}
    for kind in FAULTS:
        out[f"base_fault_{kind}"] = {**defaults(FAULTS.config(kind)), "kind": kind}
    return out


def source_hash() -> str:
    """A hash of the package's Python source: the cached nodes are this source's."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


KEEP = 8  # cache files kept: the newest sources' (checkouts of other commits, other venvs)


def cache_file() -> Path:
    return default_cache_dir() / "config-nodes" / f"{source_hash()}.json"


def cached_nodes() -> dict[str, dict[str, Any]]:
    """The nodes from the cache file of this source, else built (torch and the data stack
    load) and written there (atomically: concurrent ranks may write it at once)."""
    path = cache_file()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    built = nodes()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(built))
        os.replace(tmp, path)
        older = sorted(path.parent.glob("*.json"), key=lambda f: f.stat().st_mtime)[:-KEEP]
        for f in older:  # earlier sources' nodes (an edited checkout makes one per edit)
            f.unlink(missing_ok=True)
    except OSError:  # a read-only home: built each time, still correct
        pass
    return built


_live = False  # a registry changed since import: build from the registries themselves


def _registry_changed() -> None:
    global _live
    _live = True


on_change(_registry_changed)


def store() -> None:
    """Store every base node: from the live registries once any of them changed (or once
    they are loaded anyway), else from the cache of this source."""
    loaded = all(m in sys.modules for m in ("stabilize.monitors", "stabilize.rollback",
                                            "stabilize.faults"))  # fmt: skip
    built = nodes() if (_live or loaded) else cached_nodes()
    cs = ConfigStore.instance()
    for name, node in built.items():
        cs.store(name=name, node=node)
    for name, node in built.items():  # a kind with no option file of its own (one
        kind = name.removeprefix("base_fault_")  # registered outside the package)
        if (
            name.startswith("base_fault_")
            and not (config_dir() / "fault" / f"{kind}.yaml").is_file()
        ):
            cs.store(group="fault", name=kind, node=node)
