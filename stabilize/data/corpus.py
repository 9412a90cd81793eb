"""Corpora as HF ``datasets``: the embedded one, local files, or a hub name / dataset directory.

A corpus is a ``datasets.Dataset`` with one document per row in ``text_field``; turning it
into tokens is tokenizer.py's job.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from stabilize.data.config import SUFFIX_BUILDERS, DataConfig
from stabilize.validate import check_choice

# Between documents in the token stream, and what a .txt file's paragraphs are split on.
DOC_SEPARATOR = "\n\n"


def require_column(ds: datasets.Dataset, text_field: str) -> None:
    """A clear error when the corpus has no ``text_field`` column."""
    if text_field not in ds.column_names:
        raise ValueError(
            f"data.text_field={text_field!r} is not a column of the corpus; "
            f"columns present: {ds.column_names}"
        )


def _cap_chars(ds: datasets.Dataset, text_field: str, max_chars: int | None) -> datasets.Dataset:
    """The first documents up to max_chars characters, the last one cut to fit."""
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

    keys = sorted(topics)  # insertion order is an implementation detail; sorted is not
    ds = datasets.Dataset.from_dict({"topic": keys, "text": [topics[k] for k in keys]})
    return _cap_chars(ds, "text", max_chars)


def _load_hub(cfg: DataConfig) -> datasets.Dataset:
    # load_dataset refuses save_to_disk directories ("use load_from_disk instead"); those
    # hold state.json (a Dataset) or dataset_dict.json (a DatasetDict).
    path = Path(cfg.name)
    if any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            check_choice("data.split", cfg.split, list(ds))
            ds = ds[cfg.split]
        return ds
    try:
        return datasets.load_dataset(cfg.name, cfg.config_name, split=cfg.split)
    except ConnectionError as e:
        # Without HF_DATASETS_OFFLINE=1, an unreachable hub costs ~25 s of retries first.
        raise ConnectionError(
            f"data.name={cfg.name!r}: the hub is unreachable and no local copy exists ({e}). "
            "Use a local dataset directory, data.source='local' or data.source='embedded'."
        ) from e


def load_corpus(cfg: DataConfig) -> datasets.Dataset:
    """The corpus ``cfg`` names, capped at ``cfg.max_chars``, with its text column checked."""
    if cfg.source == "embedded":
        ds = embedded_corpus()
    elif cfg.source == "local":
        builder = SUFFIX_BUILDERS[Path(cfg.paths[0]).suffix.lower()]
        # .txt: one row per paragraph; joined again with DOC_SEPARATOR, a file gives the same
        # stream as its text would as a json or parquet row ("line" would drop the newlines).
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=cfg.paths, split="train", **kwargs)
    else:
        ds = _load_hub(cfg)
    require_column(ds, cfg.text_field)
    return _cap_chars(ds, cfg.text_field, cfg.max_chars)
