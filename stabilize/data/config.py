"""DataConfig: where the corpus comes from and how it is batched, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilize.validate import ConfigError, check_choice, check_positive, check_range

SOURCES = ("embedded", "local", "hub")
# File suffix -> the datasets packaged builder that reads it.
SUFFIX_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json"}
SUFFIX_BUILDERS |= {".parquet": "parquet"}


def check_int(key: str, value: Any, lo: int = 0, hi: int | None = None) -> None:
    """An integer in [lo, hi] (check_choice over a range would list every step)."""
    bad_int = isinstance(value, bool) or not isinstance(value, int)
    if bad_int or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{key}={value!r} is not allowed; must be {allowed}")


@dataclass
class DataConfig:
    """The ``data`` group (configs/data/): one corpus, split into train/val, and the batching.

    Every field is checked in ``__post_init__``; an invalid value names the key, the value
    and what is allowed.
    """

    source: str = "embedded"
    """embedded (CPython's pydoc topics) | local (files in ``paths``) | hub (``name``)."""
    paths: list[str] = field(default_factory=list)
    """local only: files of one type, .txt/.text, .jsonl/.json or .parquet."""
    name: str | None = None
    """hub only: a dataset name, or a local dataset / save_to_disk directory."""
    config_name: str | None = None
    """hub only: the dataset's config (e.g. wikitext-103-raw-v1)."""
    split: str = "train"
    """hub only; local files always form one "train" split."""
    text_field: str = "text"
    """The column that holds each document's text."""
    val_fraction: float = 0.05
    """The last fraction of the token stream held out for validation, in [0, 0.5)."""
    batch_size: int = 16
    """Per-device micro-batch, in blocks."""
    seed: int = 1234
    """Seeds the per-epoch permutations of the step-indexed order (sampler.py)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    max_chars: int | None = None
    """A cap on the corpus size, in characters of document text (None: all of it)."""

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, SOURCES)
        # A str or Path is one file; anything else is a sequence of them (Hydra's ListConfig
        # is converted by train.py, but a tuple should not surprise anyone either).
        raw = [self.paths] if isinstance(self.paths, (str, Path)) else list(self.paths)
        self.paths = [str(p) for p in raw]
        if self.source == "local":
            self._check_paths()
        elif self.paths:
            raise ValueError(
                f"data.paths={self.paths!r} is not allowed with data.source={self.source!r}; "
                "allowed: [] (paths are read only with data.source='local')"
            )
        # '???' is Hydra's "must be given" marker (configs/data/hub.yaml): not a name to fetch
        named = isinstance(self.name, str) and self.name not in ("", "???")
        if (self.source == "hub") != named:
            allowed = "a dataset name or directory" if self.source == "hub" else "None (hub only)"
            raise ConfigError(
                f"data.name={self.name!r} is not allowed with data.source={self.source!r}; "
                f"allowed: {allowed}"
            )
        for key in ("split", "text_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"data.{key}={value!r} is not allowed; must be a non-empty str")
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.5)
        check_positive("data.batch_size", self.batch_size, integer=True)
        check_int("data.seed", self.seed)
        check_int("data.num_workers", self.num_workers)
        if self.max_chars is not None:
            check_positive("data.max_chars", self.max_chars, integer=True)

    def _check_paths(self) -> None:
        if not self.paths:
            raise ValueError(
                "data.paths=[] is not allowed; data.source='local' needs files with suffixes "
                f"{sorted(SUFFIX_BUILDERS)}"
            )
        for p in self.paths:
            check_choice(f"data.paths[{p!r}] suffix", Path(p).suffix.lower(), SUFFIX_BUILDERS)
            if not Path(p).is_file():
                raise ValueError(f"data.paths={self.paths!r} is not allowed; no such file: {p!r}")
        builders = {SUFFIX_BUILDERS[Path(p).suffix.lower()] for p in self.paths}
        if len(builders) > 1:
            suffixes = sorted({Path(p).suffix.lower() for p in self.paths})
            raise ValueError(
                f"data.paths={self.paths!r} is not allowed: it mixes file types {suffixes}; "
                "allowed: files of one type (.txt/.text, .jsonl/.json or .parquet)"
            )
