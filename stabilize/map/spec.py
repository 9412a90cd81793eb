"""``MapSpec``: what a stability map measures (recipes x a log-spaced LR range x seeds), read
from a YAML file (configs/map/default.yaml) and checked before anything runs; and the cell,
the unit each run measures.

A recipe is a list of ``stabilize-train`` overrides (any config key: norm type, placement,
qk-norm, z-loss, reduction dtype, precision, eps, warmup). Every cell is a normal run with
every monitor on and rollback off (divergence is the measurement); ``CELL_OVERRIDES`` are
what the map adds to each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilize.paths import config_dir
from stabilize.validate import ConfigError, check_positive

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # a recipe's name is a directory


@dataclass(frozen=True)
class Cell:
    recipe: str
    lr: float
    seed: int

    @property
    def key(self) -> str:
        """The cell's directory under the recipe's: Hydra's sweep subdir, ``lr${optim.lr}``
        rendering the float as Python does."""
        return f"lr{float(self.lr)}-seed{self.seed}"


def fmt_lr(lr: float) -> str:
    """The LR as the command line and the directory name carry it (4 significant digits)."""
    return f"{lr:.4g}"


@dataclass
class MapSpec:
    name: str = "default"
    recipes: dict[str, list[str]] = field(default_factory=dict)
    lr: dict[str, float] = field(default_factory=lambda: {"min": 1e-3, "max": 1.0, "n": 6})
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    steps: int = 300
    warmup: int = 30
    early_steps: int = 50
    tail_steps: int = 20
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.match(self.name):
            raise ConfigError(f"map.name={self.name!r} is not allowed; allowed: a name of "
                              "letters, digits and _.+- (it is a directory)")  # fmt: skip
        if not isinstance(self.recipes, dict) or not self.recipes:
            raise ConfigError(f"map.recipes={self.recipes!r} is not allowed; allowed: a "
                              "mapping of at least one name to a list of overrides")  # fmt: skip
        for name, ovr in self.recipes.items():
            if not NAME.match(str(name)):
                raise ConfigError(f"map.recipes.{name} is not allowed: a recipe's name is a "
                                  "directory (letters, digits and _.+-)")  # fmt: skip
            if not isinstance(ovr, list) or not all(isinstance(o, str) and "=" in o for o in ovr):
                raise ConfigError(f"map.recipes.{name}={ovr!r} is not allowed; allowed: a "
                                  "list of key=value overrides ([] for the defaults)")  # fmt: skip
            for o in ovr:
                if o.split("=", 1)[0].lstrip("+~") in ("optim.lr", "seed"):
                    raise ConfigError(f"map.recipes.{name}: {o!r} is not allowed; the map sets "
                                      "optim.lr and seed itself (map.lr, map.seeds)")  # fmt: skip
        if set(self.lr) != {"min", "max", "n"}:
            raise ConfigError(f"map.lr={self.lr!r} is not allowed; allowed: {{min, max, n}}")
        check_positive("map.lr.min", self.lr["min"])
        check_positive("map.lr.max", self.lr["max"])
        check_positive("map.lr.n", self.lr["n"], integer=True)
        if self.lr["max"] < self.lr["min"] or (self.lr["n"] == 1) != (
            self.lr["max"] == self.lr["min"]
        ):
            raise ConfigError(f"map.lr={self.lr!r} is not allowed; allowed: min < max with "
                              "n >= 2, or min == max with n == 1")  # fmt: skip
        if not self.seeds or not all(isinstance(s, int) and s >= 0 for s in self.seeds):
            raise ConfigError(f"map.seeds={self.seeds!r} is not allowed; allowed: a list of "
                              "integers >= 0")  # fmt: skip
        for key in ("steps", "early_steps", "tail_steps"):
            check_positive(f"map.{key}", getattr(self, key), integer=True)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"map.warmup={self.warmup!r} is not allowed; allowed: an int >= 0")
        if not isinstance(self.overrides, list):
            raise ConfigError(f"map.overrides={self.overrides!r} is not allowed; allowed: a "
                              "list of overrides")  # fmt: skip

    @property
    def lrs(self) -> list[float]:
        lo, hi, n = self.lr["min"], self.lr["max"], self.lr["n"]
        if n == 1:
            return [float(lo)]
        return [float(fmt_lr(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)]

    def cells(self) -> list[Cell]:
        return [Cell(r, lr, s) for r in self.recipes for lr in self.lrs for s in self.seeds]

    def cell_overrides(self, recipe: str) -> list[str]:
        """What every cell of ``recipe`` runs with, before its LR and seed."""
        s = self.steps
        return [
            *self.overrides, *self.recipes[recipe],
            f"trainer.max_steps={s}", f"optim.warmup_steps={self.warmup}",
            *CELL_OVERRIDES, f"trainer.val_check_interval={s}",
            f"trainer.checkpoint_every_n_steps={s}",
        ]  # fmt: skip


# rollback off: divergence is the measurement; every step logged (early grad-norm
# statistics); one checkpoint and a bounded held-out score at the end; no bundles
CELL_OVERRIDES = [
    "rollback=off", "rollback.bundle=off", "trainer.log_every_n_steps=1",
    "trainer.final_eval_batches=8", "trainer.keep_checkpoints=1", "trainer.progress=plain",
]  # fmt: skip


def load_spec(path: str | Path | None = None, **overrides: Any) -> MapSpec:
    """The spec in ``path`` (default: the shipped configs/map/default.yaml), with keyword
    overrides on top; an unknown key is refused with the allowed ones."""
    from omegaconf import OmegaConf

    path = Path(path) if path else config_dir() / "map" / "default.yaml"
    if not path.is_file():
        raise ConfigError(f"--spec={str(path)!r} is not allowed; no such file")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    allowed = sorted(MapSpec.__dataclass_fields__)
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"map.{key} is not a setting of a map ({path}); allowed: {allowed}")
    return MapSpec(**raw)
