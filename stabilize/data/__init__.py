"""Data: corpora, tokenizers, packing into blocks, and a step-indexed sample order.

One concern per file, in pipeline order:

- ``config.py``: ``DataConfig`` (the ``data`` Hydra group), validated on construction.
- ``corpus.py``: the corpus as a ``datasets.Dataset`` (embedded / local files / hub).
- ``tokenizer.py``: the ``Tokenizer`` protocol, the registry (``bytes``), corpus -> stream,
  bits per byte.
- ``hf_tokenizer.py``: HF ``tokenizers`` behind the protocol (a trained byte-level BPE, a
  ``tokenizer.json``, a hub name); ``choice.py``: ``data.tokenizer`` resolved, and the
  model's vocabulary that follows it.
- ``token_file.py`` and ``cache.py``: the token cache, built once and memory-mapped by every
  rank (docs/data.md).
- ``packing.py``: the stream as next-token blocks; the contiguous train/val split.
- ``sampler.py``: the batch of every micro-step as a pure function of (seed, step).
- ``loaders.py``: ``build_dataloaders`` wires the stages for one rank.

No Lightning, Hydra or torch.distributed here: rank and world_size are passed in.
"""

from stabilize.data.cache import CachedCorpus, default_cache_dir, open_token_cache
from stabilize.data.choice import TRAINERS, TokenizerChoice, choose_tokenizer, follow_vocab
from stabilize.data.config import SOURCES, SUFFIX_BUILDERS, DataConfig, parse_skip_items
from stabilize.data.corpus import DOC_SEPARATOR, embedded_corpus, load_corpus, load_val_corpus
from stabilize.data.hf_tokenizer import HFTokenizer, train_bpe
from stabilize.data.loaders import build_dataloaders, share_skips, token_stream
from stabilize.data.packing import PackedBlocks, StepTagged, block_hash, split_stream
from stabilize.data.sampler import StepSampler, epoch_permutation
from stabilize.data.token_file import TokenArray
from stabilize.data.tokenizer import (
    DEFAULT_TOKENIZER,
    TOKENIZERS,
    ByteTokenizer,
    Tokenizer,
    bits_per_byte,
    build_tokenizer,
    register_tokenizer,
    stream_dtype,
    token_byte_counts,
    tokenize,
    unregister_tokenizer,
)

__all__ = [
    "DEFAULT_TOKENIZER",
    "DOC_SEPARATOR",
    "SOURCES",
    "SUFFIX_BUILDERS",
    "TOKENIZERS",
    "TRAINERS",
    "ByteTokenizer",
    "CachedCorpus",
    "DataConfig",
    "HFTokenizer",
    "PackedBlocks",
    "StepSampler",
    "StepTagged",
    "TokenArray",
    "Tokenizer",
    "TokenizerChoice",
    "bits_per_byte",
    "block_hash",
    "build_dataloaders",
    "build_tokenizer",
    "choose_tokenizer",
    "default_cache_dir",
    "embedded_corpus",
    "epoch_permutation",
    "follow_vocab",
    "load_corpus",
    "load_val_corpus",
    "open_token_cache",
    "parse_skip_items",
    "register_tokenizer",
    "share_skips",
    "unregister_tokenizer",
    "split_stream",
    "stream_dtype",
    "token_byte_counts",
    "token_stream",
    "tokenize",
    "train_bpe",
]
