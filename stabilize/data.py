"""Corpora, a byte tokenizer, packing into blocks, and a step-indexed sample order.

Why a step-indexed order: rollback (issue 4) rewinds to a snapshot and may skip the data that
caused a fault, and a restart must resume mid-epoch. Both are exact when the batch of every
micro-step is a pure function of (seed, step), so no sampler state has to be checkpointed.

Why bytes: tokenizer downloads fail here, a byte tokenizer needs no files, and the loss then
reads directly as bits per byte. No Lightning, Hydra or torch.distributed: rank and
world_size are passed in by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from stabilize.validate import check_choice, check_positive, check_range

SOURCES = ("embedded", "local", "hub")
# File suffix -> the datasets packaged builder that reads it.
SUFFIX_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json"}
SUFFIX_BUILDERS |= {".parquet": "parquet"}
DOC_SEPARATOR = "\n\n"


def _check_int(key: str, value: Any, lo: int = 0, hi: int | None = None) -> None:
    """An integer in [lo, hi] (check_choice over a range would list every step)."""
    bad_int = isinstance(value, bool) or not isinstance(value, int)
    if bad_int or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{key}={value!r} is not allowed; must be {allowed}")


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | local | hub
    paths: list[str] = field(default_factory=list)  # local: .txt/.text, .jsonl/.json, .parquet
    name: str | None = None  # hub: a dataset name, or a local dataset / save_to_disk directory
    config_name: str | None = None  # hub: the dataset's config
    split: str = "train"  # hub only; local files always form one "train" split
    text_field: str = "text"
    val_fraction: float = 0.05  # the last fraction of the token stream, in [0, 0.5)
    batch_size: int = 16  # per-device micro-batch
    seed: int = 1234
    num_workers: int = 0
    max_chars: int | None = None  # cap on corpus size (characters of document text)

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
        if (self.source == "hub") != (isinstance(self.name, str) and bool(self.name)):
            allowed = "a dataset name or directory" if self.source == "hub" else "None (hub only)"
            raise ValueError(f"data.name={self.name!r} is not allowed; allowed: {allowed}")
        for key in ("split", "text_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"data.{key}={value!r} is not allowed; must be a non-empty str")
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.5)
        check_positive("data.batch_size", self.batch_size, integer=True)
        _check_int("data.seed", self.seed)
        _check_int("data.num_workers", self.num_workers)
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


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary files, nothing to download, and lossless."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        # bytearray makes the array writable, so torch.from_numpy does not warn.
        return np.frombuffer(bytearray(text.encode("utf-8")), dtype=np.uint8)

    def decode(self, seq: Any) -> str:
        if isinstance(seq, torch.Tensor):
            seq = seq.detach().cpu().numpy()
        arr = np.asarray(seq)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokens must be in [0, 255]; got [{arr.min()}, {arr.max()}]")
        # A window may cut a multi-byte character in half: replace, don't raise.
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _require_column(ds: datasets.Dataset, text_field: str) -> None:
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
    _require_column(ds, cfg.text_field)
    return _cap_chars(ds, cfg.text_field, cfg.max_chars)


def tokenize(ds: datasets.Dataset, tokenizer: Any, text_field: str = "text") -> torch.Tensor:
    """One 1-D token stream: documents joined with DOC_SEPARATOR, empty ones skipped."""
    _require_column(ds, text_field)
    # The smallest dtype that holds every id: a byte corpus of 1 GB stays 1 GB in memory.
    v = tokenizer.vocab_size
    np_dtype = np.uint8 if v <= 256 else np.int16 if v <= 2**15 else np.int32
    sep = tokenizer.encode(DOC_SEPARATOR)
    parts: list[np.ndarray] = []
    for batch in ds.select_columns([text_field]).iter(batch_size=4096):
        docs = [t for t in batch[text_field] if t]
        if docs:
            if parts:
                parts.append(sep)
            parts.append(tokenizer.encode(DOC_SEPARATOR.join(docs)))
    return torch.from_numpy(np.concatenate(parts or [sep[:0]]).astype(np_dtype, copy=False))


class PackedBlocks(Dataset):
    """Item i: x = stream[i*T : i*T+T], y = stream[i*T+1 : i*T+T+1] (next-token targets).

    Windows of T+1 tokens that share only their boundary token, so every token is a target
    once per epoch; int64 because that is what embedding lookups and cross_entropy take.
    """

    def __init__(self, stream: torch.Tensor, block_size: int) -> None:
        check_positive("block_size", block_size, integer=True)
        if stream.dim() != 1:
            raise ValueError(f"stream must be 1-D; got shape {tuple(stream.shape)}")
        self.stream, self.block_size = stream, block_size

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range [0, {len(self)})")
        s, t = self.stream, self.block_size
        return s[i * t : i * t + t].long(), s[i * t + 1 : i * t + t + 1].long()


class StepTagged(Dataset):
    """Items addressed as (step, i): returns the wrapped item plus its data step."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        step, i = key
        return (*self.dataset[i], step)


def split_stream(stream: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Train = the head, val = the last val_fraction: contiguous, so no block straddles both."""
    check_range("data.val_fraction", val_fraction, 0.0, 0.5)
    n_val = int(len(stream) * val_fraction)
    cut = len(stream) - n_val
    return stream[:cut], stream[cut:]


def epoch_permutation(n_items: int, seed: int, epoch: int) -> torch.Tensor:
    """torch.randperm(n_items) from a generator seeded by (seed, epoch).

    SeedSequence mixes the pair, so (seed, epoch + 1) and (seed + 1, epoch) share nothing,
    unlike seed + epoch.
    """
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint64)
    g = torch.Generator().manual_seed(int(state[0]))
    return torch.randperm(n_items, generator=g)


class StepSampler(Sampler[list[int]]):
    """A batch sampler whose batch at each micro-step is a pure function of (seed, step).

    Slot j of rank r at micro-step s is the global position p = (s*W + r)*B + j, and the
    item is epoch_permutation(seed, p // n)[p % n]. The global sequence does not depend on
    how it is cut into ranks and batches; resuming (start_step), replaying or skipping ahead
    needs no state; ranks are disjoint within a global step, except in the one step per epoch
    that straddles the boundary, where an item may repeat across the two epochs' parts.
    """

    def __init__(
        self,
        n_items: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        *,
        num_steps: int | None,
        tagged: bool = False,
    ) -> None:
        check_positive("n_items", n_items, integer=True)
        check_positive("data.batch_size", batch_size, integer=True)
        _check_int("data.seed", seed)
        check_positive("world_size", world_size, integer=True)
        _check_int("rank", rank, 0, world_size - 1)
        if num_steps is not None:
            _check_int("num_steps", num_steps)
        _check_int("start_step", start_step, 0, num_steps)
        self.n_items, self.batch_size, self.seed = n_items, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.start_step, self.num_steps = start_step, num_steps
        self.position = start_step  # the next step to yield; seek() moves it
        self.tagged = tagged
        self._perms: dict[int, torch.Tensor] = {}  # at most the two epochs a batch can span

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = epoch_permutation(self.n_items, self.seed, epoch)
        return self._perms[epoch]

    def batch_for_step(self, step: int) -> list[int]:
        _check_int("step", step)
        p = (step * self.world_size + self.rank) * self.batch_size
        end, out = p + self.batch_size, []
        while p < end:  # one slice per epoch the batch touches
            epoch, i = divmod(p, self.n_items)
            take = min(end - p, self.n_items - i)
            out.extend(self._perm(epoch)[i : i + take].tolist())
            p += take
        return out

    def seek(self, step: int) -> None:
        """Continue from ``step`` (a rollback rewinds here, a data skip jumps ahead)."""
        _check_int("step", step)
        self.position = step

    def __iter__(self):
        # The position is re-read for every batch, so seek() takes effect mid-iteration.
        # Tagged batches carry their step: a batch fetched ahead before a seek is stale, and
        # the consumer can tell (Lightning prefetches one batch).
        while self.num_steps is None or self.position < self.num_steps:
            step = self.position
            self.position += 1
            batch = self.batch_for_step(step)
            yield [(step, i) for i in batch] if self.tagged else batch

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("an unbounded StepSampler (num_steps=None) has no length")
        return self.num_steps - self.start_step


def build_dataloaders(
    cfg: DataConfig,
    block_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    start_step: int = 0,
    num_steps: int | None,
    val_batches: int | None = None,
    tokenizer: Any = None,
    tagged: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """(train, val) loaders for one rank. The train loader yields num_steps - start_step
    micro-batches in StepSampler order (unbounded for num_steps=None; with ``tagged`` each
    batch is (x, y, steps) and the sampler is seekable through ``loader.batch_sampler``);
    val is fixed: the first val_batches batches (None: all)
    of the val blocks in order, rank r taking batches r, r+W, ... (unequal by at most one)."""
    check_positive("block_size", block_size, integer=True)
    if val_batches is not None:  # 0: no validation (as Lightning's limit_val_batches=0)
        _check_int("val_batches", val_batches)
    tokenizer = tokenizer or ByteTokenizer()
    stream = tokenize(load_corpus(cfg), tokenizer, cfg.text_field)
    train_stream, val_stream = split_stream(stream, cfg.val_fraction)
    need = block_size + 1
    if len(train_stream) < need:
        raise ValueError(
            f"the corpus is too small: {len(train_stream)} train tokens (of {len(stream)}, "
            f"after holding out data.val_fraction={cfg.val_fraction}); one block of "
            f"block_size={block_size} needs {need}. Use a larger corpus or a smaller block_size."
        )
    train = PackedBlocks(train_stream, block_size)
    val = PackedBlocks(val_stream, block_size)
    n_val = math.ceil(len(val) / cfg.batch_size)
    n_val = n_val if val_batches is None else min(n_val, val_batches)
    if cfg.val_fraction > 0 and val_batches != 0 and n_val < world_size:
        # A rank with no val batch would never join the epoch-end metric reduction.
        raise ValueError(
            f"data.val_fraction={cfg.val_fraction} gives {len(val_stream)} val tokens, "
            f"{n_val} batches of blocks of {need}; world_size={world_size} ranks need "
            "one each. Raise data.val_fraction or set it to 0."
        )
    sampler = StepSampler(
        len(train),
        cfg.batch_size,
        cfg.seed,
        rank,
        world_size,
        start_step,
        num_steps=num_steps,
        tagged=tagged,
    )
    b = cfg.batch_size
    val_index = [
        list(range(i * b, min(i * b + b, len(val)))) for i in range(rank, n_val, world_size)
    ]
    kw = dict(num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available())
    train_loader = DataLoader(StepTagged(train) if tagged else train, batch_sampler=sampler, **kw)
    return train_loader, DataLoader(val, batch_sampler=val_index, **kw)


def bits_per_byte(mean_loss_nats: float) -> float:
    """Cross-entropy in nats per token -> bits per byte (one token is one byte here)."""
    return mean_loss_nats / math.log(2)
