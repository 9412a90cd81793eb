"""Corpora as HF ``datasets``: the embedded one, local files, or a hub name / dataset directory.

A corpus is a ``datasets.Dataset`` with one document per row in ``text_field``; turning it
into tokens is tokenizer.py's job. ``load_val_corpus`` is the corpus's own validation text
when it has one (``data.val_paths``, a hub dataset's ``validation`` split), and
``corpus_identity`` is what the token cache (cache.py) keys a corpus by.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the module is imported where a corpus is loaded: a cached run needs none
    import datasets

from stabilize.compat import dataset_fingerprint
from stabilize.data.config import SUFFIX_BUILDERS, DataConfig
from stabilize.validate import ConfigError, check_choice

# Between documents in the token stream, and what a .txt file's paragraphs are split on.
DOC_SEPARATOR = "\n\n"


def _is_text(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def require_column(ds: datasets.Dataset, text_field: str) -> None:
    """A clear error when the corpus has no ``text_field`` column, or one that is not text."""
    if text_field not in ds.column_names:
        raise ConfigError(
            f"data.text_field={text_field!r} is not a column of the corpus; "
            f"columns present: {ds.column_names}"
        )
    feature = ds.features[text_field]
    if not _is_text(feature):
        texts = [c for c in ds.column_names if _is_text(ds.features[c])]
        raise ConfigError(
            f"data.text_field={text_field!r} is not allowed: that column holds {feature}, not "
            f"text; allowed: the text columns {texts}"
        )


def _cap_chars(ds: datasets.Dataset, text_field: str, max_chars: int | None) -> datasets.Dataset:
    """The first documents up to max_chars characters, the last one cut to fit."""
    import datasets

    if max_chars is None:
        return ds
    total = 0
    for start in range(0, len(ds), 1024):  # batched: a hub corpus may not fit in memory
        for i, text in enumerate(ds[start : start + 1024][text_field]):
            n = len(text or "")
            if total + n >= max_chars:
                k, keep = start + i, max_chars - total
                head = ds.select(range(k))
                if keep == 0:
                    return head
                row = ds[k]
                row[text_field] = row[text_field][:keep]
                last = datasets.Dataset.from_dict({c: [v] for c, v in row.items()}, ds.features)
                return datasets.concatenate_datasets([head, last])
            total += n
    return ds


def embedded_corpus(max_chars: int | None = None) -> datasets.Dataset:
    """English prose that ships with CPython: the ~465k characters of pydoc's help topics.

    Built in memory (Dataset.from_dict), so it needs no network, no files and no cache.
    """
    from pydoc_data.topics import topics  # lazily: only this source needs it

    import datasets

    keys = sorted(topics)  # insertion order is an implementation detail; sorted is not
    ds = datasets.Dataset.from_dict({"topic": keys, "text": [topics[k] for k in keys]})
    return _cap_chars(ds, "text", max_chars)


def _load_hub(cfg: DataConfig, split: str | None = None) -> datasets.Dataset | None:
    """The ``split`` of the hub dataset (default ``cfg.split``); None when ``split`` is given
    and the dataset does not have it (the optional validation split)."""
    import datasets

    optional = split is not None
    split = split or cfg.split
    # load_dataset refuses save_to_disk directories ("use load_from_disk instead"); those
    # hold state.json (a Dataset) or dataset_dict.json (a DatasetDict).
    path = Path(cfg.name)
    if any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if optional and split not in ds:
                return None
            check_choice("data.split", split, list(ds))
            ds = ds[split]
        elif optional:  # a bare Dataset has no other split
            return None
        return ds
    try:
        return datasets.load_dataset(cfg.name, cfg.config_name, split=split)
    except ValueError as e:
        if optional and "Unknown split" in str(e):
            return None
        raise
    except ConnectionError as e:
        if datasets.config.HF_HUB_OFFLINE:  # a setting of this environment: a config error
            raise ConfigError(
                f"data.name={cfg.name!r} is not allowed here: the dataset is not in the local "
                "cache and the hub cannot be reached (offline: HF_DATASETS_OFFLINE / "
                "HF_HUB_OFFLINE); allowed: a dataset already in the cache, a dataset directory "
                "(save_to_disk), data=local data.paths=[...] or data=embedded"
            ) from e
        # Without HF_DATASETS_OFFLINE=1, an unreachable hub costs ~25 s of retries first;
        # the network may come back: a crash (exit 1), not a setting
        raise ConnectionError(
            f"data.name={cfg.name!r}: the hub is unreachable and no local copy exists ({e}). "
            "Use a local dataset directory, data.source='local' or data.source='embedded'."
        ) from e


def corpus_name(cfg: DataConfig) -> str:
    """The setting that names the corpus, as ``key=value`` (for error messages)."""
    if cfg.source == "local":
        return f"data.paths={cfg.paths!r}"
    return f"data.name={cfg.name!r}" if cfg.source == "hub" else "data.source='embedded'"


def _load_files(cfg: DataConfig, paths: list[str], key: str) -> datasets.Dataset:
    import datasets

    # datasets fails on an empty file with an unhelpful error (or a bare StopIteration):
    # empty files hold no documents, so they are left out, and none at all is an empty corpus.
    files = [p for p in paths if os.path.getsize(p) > 0]
    if not files:
        raise ConfigError(
            f"{key}={paths!r} is not allowed: the corpus is empty (every file has 0 bytes); "
            "allowed: files with at least one non-empty document"
        )
    builder = SUFFIX_BUILDERS[Path(files[0]).suffix.lower()]
    # .txt: one row per paragraph; joined again with DOC_SEPARATOR, a file gives the same
    # stream as its text would as a json or parquet row ("line" would drop the newlines).
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    if builder in ("text", "json"):
        kwargs["encoding"] = cfg.encoding
        # checked first: datasets' error names neither the file nor the byte, and pyarrow's
        # JSON reader takes invalid UTF-8 into the table (it fails later, at tokenizing).
        # One read of the corpus, only when its token cache is built (cache.py).
        bad = undecodable(files, cfg.encoding)
        if bad is not None:
            path, offset, reason = bad
            raise ConfigError(
                f"{key}={paths!r} is not allowed with data.encoding={cfg.encoding!r}: "
                f"{path!r} does not decode as {cfg.encoding} at byte {offset} ({reason}); "
                "allowed: the file's own encoding (e.g. data.encoding=latin-1), or fix the "
                f"file (re-encode it as {cfg.encoding})"
            )
    try:  # datasets logs its reader's failure itself: quiet, the error below says it all
        with _datasets_log(logging.CRITICAL):
            return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
    except datasets.exceptions.DatasetGenerationError as e:
        # datasets' message names neither the file nor the line: find it
        found = (bad_json(p, cfg.encoding) for p in files) if builder == "json" else ()
        where = next(filter(None, found), None)
        if where is None:  # not a line we can name: the reader's own reason, on one line
            cause = e.__cause__ or e
            why = (str(cause).splitlines() or [""])[0][:200]
            where = f"the {builder} files cannot be read ({type(cause).__name__}: {why})"
        raise ConfigError(
            f"{key}={paths!r} is not allowed: {where}; allowed: files that parse as "
            f"{builder} (JSON Lines: one JSON object per line), fixed or left out"
        ) from None


@contextlib.contextmanager
def _datasets_log(level: int) -> Iterator[None]:
    logger = logging.getLogger("datasets")
    was = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(was)


def bad_json(path: str, encoding: str) -> str | None:
    """Where a ``.json``/``.jsonl`` file does not parse, as ``'FILE' line N: why``; None
    when it does. JSON Lines (a first line that is an object on its own) line by line, read
    as a stream; else the file is one JSON document (datasets' fallback) and the decoder's
    line is named."""
    with open(path, encoding=encoding) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        lines = isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        lines = False
    if not lines:
        try:
            with open(path, encoding=encoding) as f:
                json.load(f)
        except json.JSONDecodeError as e:
            return f"{path!r} line {e.lineno} is not JSON ({_why(e)})"
        return None
    with open(path, encoding=encoding) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path!r} line {n} is not JSON ({_why(e)})"
            if not isinstance(row, dict):
                return f"{path!r} line {n} is not a JSON object (a {type(row).__name__})"
    return None


def _why(e: json.JSONDecodeError) -> str:
    return f"{e.msg.removesuffix(' at').lower()} at column {e.colno}"


def undecodable(paths: list[str], encoding: str) -> tuple[str, int, str] | None:
    """The first of ``paths`` that does not decode as ``encoding``: (file, offset of the
    first bad byte in it, the codec's reason); None when every file decodes. Read in
    chunks: a corpus need not fit in memory."""
    for path in paths:
        decoder = codecs.getincrementaldecoder(encoding)()
        done = 0  # bytes of the file handed to the decoder before this chunk
        with open(path, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                held = len(decoder.getstate()[0])  # a sequence cut by the previous chunk
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:  # e.start: into held bytes + this chunk
                    return path, done - held + e.start, e.reason
                if not chunk:
                    break
                done += len(chunk)
    return None


def load_corpus(cfg: DataConfig) -> datasets.Dataset:
    """The corpus ``cfg`` names, capped at ``cfg.max_chars``, with its text column checked."""
    if cfg.source == "embedded":
        ds = embedded_corpus()
    elif cfg.source == "local":
        ds = _load_files(cfg, cfg.paths, "data.paths")
    else:
        ds = _load_hub(cfg)
    require_column(ds, cfg.text_field)
    return _cap_chars(ds, cfg.text_field, cfg.max_chars)


def load_val_corpus(cfg: DataConfig) -> datasets.Dataset | None:
    """The corpus's own validation text (``data.val_paths``, or the hub dataset's
    ``data.val_split`` when it has one), not capped; None: hold out the tail instead."""
    if cfg.source == "local" and cfg.val_paths:
        ds = _load_files(cfg, cfg.val_paths, "data.val_paths")
    elif cfg.source == "hub" and cfg.val_split and cfg.val_split != cfg.split:
        ds = _load_hub(cfg, cfg.val_split)
        if ds is None:
            return None
    else:
        return None
    require_column(ds, cfg.text_field)
    return ds


def _file_ids(paths: list[str]) -> list[list[Any]]:
    # Paths, sizes and modification times, not a content hash: a hit costs a stat per file
    # instead of reading the whole corpus on every launch of every rank; any write to a file
    # changes its mtime (docs/data.md says what this misses).
    return [[str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]


def _hub_id(ds: datasets.Dataset) -> str:
    # datasets' own fingerprint of the prepared split (its builder config and data files);
    # it is what datasets itself keys its cache by.
    return dataset_fingerprint(ds)


def corpus_identity(cfg: DataConfig) -> dict[str, Any]:
    """What the corpus of ``cfg`` is, as JSON-able data: equal identities, equal text.

    embedded: a hash of the text (465k characters, ~1 ms); local: each file's resolved path,
    size and mtime (no read); hub: datasets' fingerprint of the split (loading it is a
    memory-mapped cache hit after the first launch).
    """
    ident: dict[str, Any] = {"source": cfg.source, "text_field": cfg.text_field}
    ident["max_chars"] = cfg.max_chars
    if cfg.source == "embedded":
        from pydoc_data.topics import topics  # embedded_corpus's text, without datasets

        text = "\x00".join(topics[k] for k in sorted(topics))
        ident["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    elif cfg.source == "local":
        ident["files"] = _file_ids(cfg.paths)
        ident["encoding"] = cfg.encoding  # the same bytes are other text in another one
        ident["val_files"] = _file_ids(cfg.val_paths)
    else:
        ident |= {"name": cfg.name, "config_name": cfg.config_name, "split": cfg.split}
        ident["fingerprint"] = _hub_id(_load_hub(cfg))
        val = load_val_corpus(cfg)
        ident["val"] = None if val is None else [cfg.val_split, _hub_id(val)]
    return ident
