"""Tokenizers behind one small protocol, registered by name, and a corpus -> token stream.

Why bytes by default: tokenizer downloads fail here, a byte tokenizer needs no files, and the
loss then reads directly as bits per byte. A new tokenizer is a class with ``vocab_size``,
``encode`` and ``decode``, decorated with ``@register_tokenizer("name")``; ``build_tokenizer``
then accepts the name and its error lists it among the allowed ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import datasets
import numpy as np
import torch

from stabilize.data.corpus import DOC_SEPARATOR, require_column
from stabilize.validate import check_choice


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline asks of a tokenizer: ids in [0, vocab_size), both ways."""

    vocab_size: int
    """Ids are in [0, vocab_size); the model's ``vocab_size`` must be at least this."""

    def encode(self, text: str) -> np.ndarray:
        """Text -> a 1-D integer array of ids."""
        ...

    def decode(self, seq: Any) -> str:
        """Ids (an array, a tensor or a list) -> text; must not raise on a cut-off window."""
        ...


# name -> a zero-argument factory (usually the class itself).
TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {}
DEFAULT_TOKENIZER = "bytes"


def register_tokenizer(name: str) -> Callable[[Callable[[], Tokenizer]], Callable[[], Tokenizer]]:
    """Class decorator: make the tokenizer buildable by ``name``."""

    def add(factory: Callable[[], Tokenizer]) -> Callable[[], Tokenizer]:
        if name in TOKENIZERS and TOKENIZERS[name] is not factory:
            raise ValueError(f"tokenizer {name!r} is already registered ({TOKENIZERS[name]!r})")
        TOKENIZERS[name] = factory
        return factory

    return add


def build_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """The registered tokenizer called ``name``; an unknown name lists the registered ones."""
    check_choice("tokenizer", name, sorted(TOKENIZERS))
    return TOKENIZERS[name]()


@register_tokenizer("bytes")
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


def tokenize(ds: datasets.Dataset, tokenizer: Tokenizer, text_field: str = "text") -> torch.Tensor:
    """One 1-D token stream: documents joined with DOC_SEPARATOR, empty ones skipped."""
    require_column(ds, text_field)
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


def bits_per_byte(mean_loss_nats: float) -> float:
    """Cross-entropy in nats per token -> bits per byte (one token is one byte here).

    Only true for the byte tokenizer: a tokenizer with several bytes per token divides by
    its bytes per token as well.
    """
    return mean_loss_nats / math.log(2)
