"""The (train, val) DataLoaders of one rank: corpus -> tokens -> blocks -> step-indexed order.

Each stage is its own file (corpus.py, tokenizer.py, cache.py, packing.py, sampler.py); this
one only wires them and checks that the corpus is large enough for the block size and the
ranks. The tokens come memory-mapped from the token cache (cache.py), unless a tokenizer
object is passed in (then they are tokenized in memory, uncached: an object has no name to
key a cache by).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from stabilize.data.cache import open_token_cache
from stabilize.data.config import DataConfig, check_int
from stabilize.data.corpus import load_corpus
from stabilize.data.packing import PackedBlocks, StepTagged, split_stream
from stabilize.data.sampler import StepSampler
from stabilize.data.tokenizer import Tokenizer, token_byte_counts, tokenize
from stabilize.validate import ConfigError, check_positive


def token_stream(cfg: DataConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """The whole corpus of ``cfg`` as one 1-D token stream in memory (no cache)."""
    return tokenize(load_corpus(cfg), tokenizer, cfg.text_field)


def build_dataloaders(
    cfg: DataConfig,
    block_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    start_step: int = 0,
    num_steps: int | None,
    val_batches: int | None = None,
    tokenizer: Tokenizer | None = None,
    tagged: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """(train, val) loaders for one rank. The train loader yields num_steps - start_step
    micro-batches in StepSampler order (unbounded for num_steps=None; with ``tagged`` each
    batch is (x, y, steps) and the sampler is seekable through ``loader.batch_sampler``);
    val is fixed: the first val_batches batches (None: all)
    of the val blocks in order, rank r taking batches r, r+W, ... (unequal by at most one)."""
    check_positive("block_size", block_size, integer=True)
    if val_batches is not None:  # 0: no validation (as Lightning's limit_val_batches=0)
        check_int("val_batches", val_batches)
    if tokenizer is not None:
        stream, own_val = token_stream(cfg, tokenizer), None
        token_bytes = token_byte_counts(tokenizer)
    else:
        cached = open_token_cache(cfg)
        stream, own_val, token_bytes = cached.train, cached.val, cached.token_bytes
    if own_val is None:
        train_stream, val_stream = split_stream(stream, cfg.val_fraction)
        val_source = f"data.val_fraction={cfg.val_fraction} gives"
    else:  # the corpus's own validation text: the whole stream trains
        train_stream, val_stream = stream, own_val
        val_source = "the validation split has"
    need = block_size + 1
    if len(train_stream) < need:
        raise ConfigError(
            f"the corpus is too small: {len(train_stream)} train tokens (of {len(stream)}, "
            f"after holding out data.val_fraction={cfg.val_fraction}); one block of "
            f"block_size={block_size} needs {need}. Use a larger corpus or a smaller block_size."
        )
    train = PackedBlocks(train_stream, block_size)
    val = PackedBlocks(val_stream, block_size, token_bytes=token_bytes)
    n_val = math.ceil(len(val) / cfg.batch_size)
    n_val = n_val if val_batches is None else min(n_val, val_batches)
    if (cfg.val_fraction > 0 or own_val is not None) and val_batches != 0 and n_val < world_size:
        # A rank with no val batch would never join the epoch-end metric reduction.
        raise ConfigError(
            f"{val_source} {len(val_stream)} val tokens, "
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


def share_skips(loader: DataLoader, positions: set[int], items: dict[int, str]) -> None:
    """Make ``loader``'s sampler hold these very skip sets (later skips apply too), once
    every skipped item's content is checked against this corpus's block at that index."""
    blocks = loader.dataset
    blocks = getattr(blocks, "dataset", blocks)  # StepTagged wraps PackedBlocks
    for i, digest in sorted(items.items()):
        have = blocks.item_hash(i) if 0 <= i < len(blocks) else None
        if have != digest:
            found = f"hashes to {have}" if have else f"is not one of its {len(blocks)} blocks"
            raise ConfigError(
                f"data.skip_items: '{i}:{digest}' is not allowed here: block {i} of this "
                f"corpus {found}; the sequence recorded is not at that index (another "
                "corpus, tokenizer or block_size)"
            )
    loader.batch_sampler.skip = positions
    loader.batch_sampler.skip_items = items
