"""The token cache: a corpus tokenized once into files on disk, shared by every rank, every
launch, every resume and every sweep member that reads the same corpus with the same
tokenizer (the layout is in docs/data.md).

One directory per fingerprint under ``<cache_dir>/tokens/``: ``meta.json`` (sizes, dtype,
checksums, what went into the fingerprint), ``train.bin``, ``val.bin`` when the corpus has
its own validation text, ``tokenizer.json`` for a trained tokenizer.

Who builds: whoever first takes ``<fingerprint>.lock`` exclusively. Every process checks the
entry under a shared lock (checks run side by side); one that finds it missing or corrupt
lets go, takes the lock exclusively, checks again (another may have built it meanwhile) and
builds into a temporary directory renamed into place. A crashed builder's lock dies with
it. No torch.distributed: ranks only meet in the file system, so any launcher works, and on
a node-local cache dir each node builds its own copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stabilize.data.choice import TokenizerChoice, choose_tokenizer
from stabilize.data.config import DataConfig
from stabilize.data.corpus import corpus_identity, corpus_name, load_corpus, load_val_corpus
from stabilize.data.hf_tokenizer import load_file
from stabilize.data.token_file import TokenArray, file_crc32, write_tokens
from stabilize.data.tokenizer import (
    Tokenizer,
    encode_documents,
    stream_dtype,
    text_batches,
    token_byte_counts,
)
from stabilize.paths import default_cache_dir
from stabilize.validate import ConfigError

log = logging.getLogger("stabilize.data")
CACHE_VERSION = 1  # bump when the files' layout or meaning changes: every entry rebuilds
TOKENIZER_FILE = "tokenizer.json"


# Entries this process has checked -> the stat of their files then: the start-up check
# (run/preflight.py) and the run's loaders open the same entry, and the second open maps it
# without reading every byte again (any write to a file changes its stat: checked again).
_CHECKED: dict[Path, tuple] = {}


def _stamp(entry: Path) -> tuple:
    files = sorted(entry.iterdir()) if entry.is_dir() else []
    return tuple((f.name, f.stat().st_ino, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@dataclass
class CachedCorpus:
    """A corpus as memory-mapped token files, and the tokenizer that made them."""

    train: TokenArray
    val: TokenArray | None
    """The corpus's own validation tokens; None: hold out the tail of ``train``."""
    tokenizer: Tokenizer
    token_bytes: torch.Tensor
    """int64 [vocab_size]: UTF-8 bytes behind each id (bits per byte)."""
    fingerprint: str
    path: Path
    """The cache entry's directory."""


def fingerprint(cfg: DataConfig, choice: TokenizerChoice) -> tuple[str, dict[str, Any]]:
    """sha256 over the corpus's identity, the tokenizer's and the cache layout version.
    Batching settings (batch size, seed, val_fraction, block size) are not in it: they are
    applied to the mapped stream, so runs and sweeps that differ only there share an entry."""
    inputs = {"version": CACHE_VERSION, "corpus": corpus_identity(cfg), "tokenizer": choice.key}
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32], inputs


def _cache_root(cfg: DataConfig) -> Path:
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    tokens = root / "tokens"
    try:
        tokens.mkdir(parents=True, exist_ok=True)
        probe = tokens / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"data.cache_dir={cfg.cache_dir!r} is not allowed: {root} is not writable "
            f"({e.strerror or e}); allowed: a writable directory, or None for "
            f"{default_cache_dir()}"
        ) from None
    return tokens


@contextlib.contextmanager
def _locked(path: Path, exclusive: bool):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _problem(entry: Path, fp: str) -> str | None:
    """Why the entry cannot be used (None: it can): missing, another version, or a file
    whose size or checksum differs from the one recorded when it was written."""
    meta_path = entry / "meta.json"
    if not meta_path.is_file():
        return "missing" if not entry.exists() else "incomplete (no meta.json)"
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("version") != CACHE_VERSION or meta.get("fingerprint") != fp:
            return "written by another version"
        for name, rec in meta["files"].items():
            path = entry / name
            if not path.is_file() or path.stat().st_size != rec["bytes"]:
                size = path.stat().st_size if path.is_file() else "no file"
                return f"corrupt: {name} has {size} bytes, {rec['bytes']} recorded"
            if file_crc32(path) != rec["crc32"]:
                return f"corrupt: {name} does not match its recorded checksum"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corrupt: unreadable meta.json ({e})"
    return None


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _build(cfg: DataConfig, choice: TokenizerChoice, tmp: Path, fp: str, inputs: dict) -> None:
    """Tokenize the corpus into ``tmp`` (renamed into place by the caller)."""
    t0 = time.perf_counter()
    tmp.mkdir(parents=True)
    ds = load_corpus(cfg)
    tok = choice.loaded
    if tok is None:  # trained: on the training text only, saved beside the tokens
        tok = choice.train(text_batches(ds, cfg.text_field), cfg.vocab_size)
        tok.save(tmp / TOKENIZER_FILE)
    dtype = stream_dtype(tok.vocab_size)
    files: dict[str, Any] = {}
    splits = [("train", ds, corpus_name(cfg))]
    val = load_val_corpus(cfg)
    if val is not None:
        key = "data.val_paths" if cfg.source == "local" else "data.val_split"
        splits.append(("val", val, f"{key}={getattr(cfg, key[5:])!r}"))
    for split, corpus, name in splits:
        pieces = encode_documents(text_batches(corpus, cfg.text_field), tok)
        n, crc = write_tokens(tmp / f"{split}.bin", pieces, dtype, tok.vocab_size)
        if n == 0:
            cap = f" within data.max_chars={cfg.max_chars}" if cfg.max_chars else ""
            raise ConfigError(
                f"{name} is not allowed: the corpus is empty (no text in column "
                f"{cfg.text_field!r}{cap}); allowed: a corpus with at least one non-empty "
                "document"
            )
        files[f"{split}.bin"] = {"bytes": n * dtype.itemsize, "crc32": crc, "tokens": n}
    if (tmp / TOKENIZER_FILE).is_file():
        path = tmp / TOKENIZER_FILE
        files[TOKENIZER_FILE] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    meta = {
        "version": CACHE_VERSION,
        "fingerprint": fp,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": {"kind": choice.kind, "name": choice.name},
        "files": files,
        "inputs": inputs,
        "built_by": {"host": socket.gethostname(), "pid": os.getpid(), "rank": _rank()},
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # written last: the commit


def _ensure_built(cfg: DataConfig, choice: TokenizerChoice, tokens: Path, fp: str, inputs):
    entry, lock = tokens / fp, tokens / f"{fp}.lock"
    with _locked(lock, exclusive=False):
        problem = _problem(entry, fp)
    if problem is None:
        return
    with _locked(lock, exclusive=True):
        problem = _problem(entry, fp)  # someone may have built it while we waited
        if problem is None:
            return
        if problem != "missing":
            log.warning("token cache %s: %s; rebuilding [rank %s]", fp, problem, _rank())
        for stale in tokens.glob(f"{fp}.tmp-*"):  # a crashed builder's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tokens / f"{fp}.tmp-{os.getpid()}"
        log.info(
            "token cache %s: building (%s, tokenizer %s) under %s [rank %s]",
            fp, corpus_name(cfg), cfg.tokenizer, tokens, _rank(),
        )  # fmt: skip
        try:
            _build(cfg, choice, tmp, fp, inputs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if entry.exists():  # the corrupt one: out of the way, then gone
            trash = tokens / f"{fp}.corrupt-{os.getpid()}"
            entry.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp.rename(entry)


def open_token_cache(cfg: DataConfig) -> CachedCorpus:
    """The corpus of ``cfg`` tokenized, from the cache (built first if need be), mapped."""
    t0 = time.perf_counter()
    choice = choose_tokenizer(cfg)
    tokens = _cache_root(cfg)
    fp, inputs = fingerprint(cfg, choice)
    entry = tokens / fp
    stamp = _stamp(entry)
    first_open = not stamp or _CHECKED.get(entry) != stamp
    if first_open:
        _ensure_built(cfg, choice, tokens, fp, inputs)
        _CHECKED[entry] = _stamp(entry)
    meta = json.loads((entry / "meta.json").read_text())
    tok = choice.loaded if choice.loaded is not None else load_file(entry / TOKENIZER_FILE)
    train = TokenArray(entry / "train.bin", meta["dtype"])
    val = TokenArray(entry / "val.bin", meta["dtype"]) if (entry / "val.bin").is_file() else None
    counts = token_byte_counts(tok)
    (log.info if first_open else log.debug)(
        "token cache %s: memory-mapped (%d train%s tokens, %s) in %.2f s [rank %s]",
        fp, len(train), f" + {len(val)} val" if val else "", meta["dtype"],
        time.perf_counter() - t0, _rank(),
    )  # fmt: skip
    return CachedCorpus(train, val, tok, counts, fp, entry)
