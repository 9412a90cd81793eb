"""``data.tokenizer`` resolved: which tokenizer, how many ids, and what identifies it.

Four kinds, tried in this order:
- registered: a name in ``TOKENIZERS`` (``bytes``), built with no files (tokenizer.py);
- trained: a name in ``TRAINERS`` (``bpe``), trained on the training text when the token
  cache is built and saved beside it (cache.py);
- file: a path to a ``tokenizer.json``, or to a directory saved by ``transformers``;
- hub: anything else, as a hub name (needs the network).

A new trained tokenizer: a function ``(batches of documents, vocab_size) -> Tokenizer`` in
``TRAINERS``; its recipe version goes into the fingerprint so a change rebuilds its caches.
The choice is cheap to make (no corpus is read) so the run config can size the model with it
before anything is written (``follow_vocab``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilize.data import hf_tokenizer
from stabilize.data.config import DataConfig
from stabilize.data.tokenizer import TOKENIZERS, Tokenizer, build_tokenizer
from stabilize.validate import ConfigError

# name -> (trainer, recipe version).
TRAINERS: dict[str, tuple[Callable[[Any, int], Tokenizer], int]] = {
    "bpe": (hf_tokenizer.train_bpe, hf_tokenizer.BPE_RECIPE),
}


def _looks_like_path(name: str) -> bool:
    # A hub name is "org/name" or "name"; these can only be meant as files.
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".json")


@dataclass
class TokenizerChoice:
    """A resolved ``data.tokenizer``: its kind, its id range and its identity."""

    kind: str
    """registered | trained | file | hub."""
    name: str
    """The ``data.tokenizer`` value."""
    vocab_size: int
    """Every id is below it (trained: the requested size, an upper bound)."""
    key: dict[str, Any]
    """What identifies it in the token cache's fingerprint (JSON-able)."""
    loaded: Tokenizer | None = field(default=None, repr=False)
    """Already built (registered, file and hub kinds); trained ones come from the cache."""

    def train(self, batches: Any, vocab_size: int) -> Tokenizer:
        return TRAINERS[self.name][0](batches, vocab_size)


def _allowed() -> str:
    names = sorted({*TOKENIZERS, *TRAINERS})
    return f"{names}, a path to tokenizer.json or a tokenizer directory, or a hub name (online)"


def choose_tokenizer(cfg: DataConfig) -> TokenizerChoice:
    """Resolve ``cfg.tokenizer``; an unusable value fails naming the key, value and allowed."""
    name = cfg.tokenizer
    if name in TOKENIZERS:
        tok = build_tokenizer(name)
        cls = type(tok)
        key = {"registered": name, "class": f"{cls.__module__}.{cls.__qualname__}"}
        key["version"] = getattr(tok, "cache_version", 0)
        return TokenizerChoice("registered", name, tok.vocab_size, key, tok)
    if name in TRAINERS:
        key = {"trained": name, "vocab_size": cfg.vocab_size, "recipe": TRAINERS[name][1]}
        return TokenizerChoice("trained", name, cfg.vocab_size, key)
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        file = tokenizer_file_or_fail(name, path)
        tok = hf_tokenizer.load_file(file)
        return TokenizerChoice("file", name, tok.vocab_size, _content_key(tok), tok)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: no such file or directory, and the hub "
            f"is off (HF_HUB_OFFLINE is set); allowed: {_allowed()}"
        )
    try:
        tok = hf_tokenizer.load_hub(name)
    except Exception as e:  # tokenizers raises a bare Exception for a failed download
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: no such file or directory, and the hub "
            f"has no such tokenizer or is unreachable ({first}); allowed: {_allowed()}"
        ) from e
    return TokenizerChoice("hub", name, tok.vocab_size, _content_key(tok), tok)


def tokenizer_file_or_fail(name: str, path: Path) -> Path:
    if not path.exists():
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: no such file or directory; "
            f"allowed: {_allowed()}"
        )
    file = hf_tokenizer.tokenizer_file(path)
    if file is None:
        raise ConfigError(
            f"data.tokenizer={name!r} is not allowed: the directory has no tokenizer.json "
            "(save a fast tokenizer with transformers' save_pretrained); allowed: "
            f"{_allowed()}"
        )
    return file


def _content_key(tok: hf_tokenizer.HFTokenizer) -> dict[str, Any]:
    # The serialized tokenizer itself, not where it came from: a file edited in place or a
    # hub revision changes the key, a copy elsewhere does not.
    return {"tokenizer_sha256": hashlib.sha256(tok.tok.to_str().encode()).hexdigest()}


def follow_vocab(cfg: DataConfig, model_vocab: int, preset_vocab: int, tok_vocab: int) -> int:
    """The model's ``vocab_size`` for a tokenizer of ``tok_vocab`` ids: the tokenizer's when
    ``model_vocab`` was left at its preset's value (``preset_vocab``) and the tokenizer is not
    ``bytes`` (whose 256 ids fit every preset: the gpt-* presets keep GPT-2's 50,257, which
    their published sizes count); otherwise ``model_vocab`` (the caller checks that the ids
    fit it)."""
    if model_vocab == preset_vocab and cfg.tokenizer != "bytes":
        return tok_vocab
    return model_vocab
