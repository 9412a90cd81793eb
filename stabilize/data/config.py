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
        raise ConfigError(f"{key}={value!r} is not allowed; must be {allowed}")


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
    encoding: str = "utf-8"
    """local .txt/.jsonl/.json files only: the text encoding they are written in (any codec
    Python knows: utf-8, latin-1, cp1252, ...)."""
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
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes, ids 0-255) | bpe (a byte-level BPE trained on the training text,
    ``vocab_size`` ids) | another registered name | a path to a ``tokenizer.json`` or to a
    directory saved by ``transformers`` | a hub name (online only). See choice.py."""
    vocab_size: int = 8192
    """bpe only: the vocabulary to train, at least the 256 byte ids (read by nothing else)."""
    cache_dir: str | None = None
    """Where token caches live (docs/data.md). None: $STABILIZE_CACHE_DIR, else
    $XDG_CACHE_HOME/stabilize, else ~/.cache/stabilize."""
    val_paths: list[str] = field(default_factory=list)
    """local only: files holding the validation text (same type as ``paths``); [] holds out
    the tail of the stream (``val_fraction``)."""
    val_split: str | None = "validation"
    """hub only: the dataset's own validation split, used when the dataset has it (then
    ``val_fraction`` is not used); None: always the tail split."""

    skip_items: list[str] = field(default_factory=list)
    """Training sequences never trained on, each ``"INDEX:HASH"``: the block index and its
    content hash (``packing.block_hash``), as ``stabilize-replay --data`` prints them. A
    block whose content does not hash to HASH is refused at start-up (another corpus,
    tokenizer or block_size). Each is replaced by the next block in corpus order."""

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, SOURCES)
        self.skip_items = [str(s) for s in _as_list(self.skip_items)]
        parse_skip_items(self.skip_items)
        self.paths, self.val_paths = _as_list(self.paths), _as_list(self.val_paths)
        if self.source == "local":
            self._check_paths("data.paths", self.paths)
            if self.val_paths:
                self._check_paths("data.val_paths", self.val_paths)
                self._check_one_type([*self.paths, *self.val_paths])
        for key in ("paths", "val_paths"):
            if self.source != "local" and getattr(self, key):
                raise ConfigError(
                    f"data.{key}={getattr(self, key)!r} is not allowed with data.source="
                    f"{self.source!r}; allowed: [] (read only with data.source='local')"
                )
        # '???' is Hydra's "must be given" marker (a config saved when configs/data/hub.yaml
        # held it, or a user's own): not a name to fetch
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
                raise ConfigError(f"data.{key}={value!r} is not allowed; must be a non-empty str")
        if not isinstance(self.encoding, str) or not _is_text_encoding(self.encoding):
            raise ConfigError(
                f"data.encoding={self.encoding!r} is not allowed; allowed: a text encoding "
                "Python knows (e.g. 'utf-8', 'latin-1', 'cp1252'; see Python's codecs module)"
            )
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.5)
        check_positive("data.batch_size", self.batch_size, integer=True)
        check_int("data.seed", self.seed)
        check_int("data.num_workers", self.num_workers)
        if self.max_chars is not None:
            check_positive("data.max_chars", self.max_chars, integer=True)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r} is not allowed; must be a non-empty str "
                "(bytes, bpe, a tokenizer path or a hub name)"
            )
        check_int("data.vocab_size", self.vocab_size, 256, 2**32)
        for key in ("cache_dir", "val_split"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"data.{key}={value!r} is not allowed; allowed: None or a str")

    @staticmethod
    def _check_paths(key: str, paths: list[str]) -> None:
        if not paths:
            raise ConfigError(
                f"{key}=[] is not allowed; data.source='local' needs files with suffixes "
                f"{sorted(SUFFIX_BUILDERS)}"
            )
        for p in paths:
            check_choice(f"{key}[{p!r}] suffix", Path(p).suffix.lower(), SUFFIX_BUILDERS)
            if not Path(p).is_file():
                raise ConfigError(f"{key}={paths!r} is not allowed; no such file: {p!r}")
        DataConfig._check_one_type(paths, key)

    @staticmethod
    def _check_one_type(paths: list[str], key: str = "data.paths + data.val_paths") -> None:
        builders = {SUFFIX_BUILDERS[Path(p).suffix.lower()] for p in paths}
        if len(builders) > 1:
            suffixes = sorted({Path(p).suffix.lower() for p in paths})
            raise ConfigError(
                f"{key}={paths!r} is not allowed: it mixes file types {suffixes}; "
                "allowed: files of one type (.txt/.text, .jsonl/.json or .parquet)"
            )


def parse_skip_items(entries: list[str]) -> dict[int, str]:
    """``data.skip_items`` as {block index: content hash}; a malformed entry is refused."""
    out: dict[int, str] = {}
    for k, e in enumerate(entries):
        index, _, digest = str(e).partition(":")
        ok = index.isdigit() and len(digest) == 16
        ok = ok and all(c in "0123456789abcdef" for c in digest)
        if not ok:
            raise ConfigError(
                f"data.skip_items[{k}]={e!r} is not allowed; allowed: 'INDEX:HASH', a block "
                "index and its 16-hex-digit content hash (as stabilize-replay --data prints)"
            )
        out[int(index)] = digest
    return out


def _is_text_encoding(name: str) -> bool:
    """A codec Python knows that decodes bytes to text (not base64, rot13, ...)."""
    try:
        b"a".decode(name)  # not b"": an empty input is decoded without looking the codec up
    except UnicodeError:  # a text codec (utf-16 wants 2 bytes)
        return True
    except (LookupError, ValueError, TypeError):  # unknown, or bytes -> bytes / str -> str
        return False
    return True


def _as_list(paths: Any) -> list[str]:
    """A str or Path is one file; anything else is a sequence of them (Hydra's ListConfig is
    converted by train.py, but a tuple should not surprise anyone either)."""
    raw = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return [str(p) for p in raw]
