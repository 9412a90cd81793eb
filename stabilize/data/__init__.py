"""Data: corpora, tokenizers, packing into blocks, and a step-indexed sample order.

One concern per file, in pipeline order:

- ``config.py``: ``DataConfig`` (the ``data`` Hydra group), validated on construction.
- ``corpus.py``: the corpus as a ``datasets.Dataset`` (embedded / local files / hub).
- ``tokenizer.py``: the ``Tokenizer`` protocol, the registry (``bytes``), corpus -> stream,
  bits per byte.
- ``packing.py``: the stream as next-token blocks; the contiguous train/val split.
- ``sampler.py``: the batch of every micro-step as a pure function of (seed, step).
- ``loaders.py``: ``build_dataloaders`` wires the stages for one rank.

No Lightning, Hydra or torch.distributed here: rank and world_size are passed in.
"""

from stabilize.data.config import SOURCES, SUFFIX_BUILDERS, DataConfig
from stabilize.data.corpus import DOC_SEPARATOR, embedded_corpus, load_corpus
from stabilize.data.loaders import build_dataloaders, token_stream
from stabilize.data.packing import PackedBlocks, StepTagged, split_stream
from stabilize.data.sampler import StepSampler, epoch_permutation
from stabilize.data.tokenizer import (
    DEFAULT_TOKENIZER,
    TOKENIZERS,
    ByteTokenizer,
    Tokenizer,
    bits_per_byte,
    build_tokenizer,
    register_tokenizer,
    tokenize,
)

__all__ = [
    "DEFAULT_TOKENIZER",
    "DOC_SEPARATOR",
    "SOURCES",
    "SUFFIX_BUILDERS",
    "TOKENIZERS",
    "ByteTokenizer",
    "DataConfig",
    "PackedBlocks",
    "StepSampler",
    "StepTagged",
    "Tokenizer",
    "bits_per_byte",
    "build_dataloaders",
    "build_tokenizer",
    "embedded_corpus",
    "epoch_permutation",
    "load_corpus",
    "register_tokenizer",
    "split_stream",
    "token_stream",
    "tokenize",
]
