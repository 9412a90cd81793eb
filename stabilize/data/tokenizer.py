"""Tokenizers behind one small protocol, registered by name, and a corpus -> token stream.

Why bytes by default: tokenizer downloads fail here, a byte tokenizer needs no files, and the
loss then reads directly as bits per byte. A new tokenizer is a class with ``vocab_size``,
``encode`` and ``decode``, decorated with ``@register_tokenizer("name")``; ``build_tokenizer``
then accepts the name and its error lists it among the allowed ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:  # annotations only
    import datasets

from stabilize.data.corpus import DOC_SEPARATOR, require_column
from stabilize.registry import Registry


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


# Optional, looked up with getattr (a tokenizer without them still works):
# - ``encode_batch(texts) -> list[np.ndarray]``: many documents at once (the HF tokenizers
#   encode them on all cores); without it a batch is encoded as one joined text.
# - ``token_bytes() -> np.ndarray``: the UTF-8 bytes of text behind each id, for bits per
#   byte; without it every id counts one byte (true of ``bytes`` only).


# name -> a zero-argument factory (usually the class itself); tokenizers have no settings.
TOKENIZERS: Registry[Callable[[], Tokenizer]] = Registry("tokenizer")
DEFAULT_TOKENIZER = "bytes"


def register_tokenizer(name: str) -> Callable[[Callable[[], Tokenizer]], Callable[[], Tokenizer]]:
    """Class decorator: make the tokenizer buildable by ``name`` (the same class again is a
    no-op; another one under a taken name is refused)."""

    def add(factory: Callable[[], Tokenizer]) -> Callable[[], Tokenizer]:
        return TOKENIZERS.register(name, factory)

    return add


def unregister_tokenizer(name: str) -> None:
    """Remove a registered tokenizer (tests registering their own clean up with this)."""
    TOKENIZERS.unregister(name)


def build_tokenizer(name: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """The registered tokenizer called ``name``; an unknown name lists the registered ones."""
    return TOKENIZERS.lookup(name)()


@register_tokenizer("bytes")
class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary files, nothing to download, and lossless."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        # bytearray makes the array writable, so torch.from_numpy does not warn.
        return np.frombuffer(bytearray(text.encode("utf-8")), dtype=np.uint8)

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def decode(self, seq: Any) -> str:
        if isinstance(seq, torch.Tensor):
            seq = seq.detach().cpu().numpy()
        arr = np.asarray(seq)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokens must be in [0, 255]; got [{arr.min()}, {arr.max()}]")
        # A window may cut a multi-byte character in half: replace, don't raise.
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def text_batches(ds: datasets.Dataset, text_field: str, size: int = 4096) -> Iterator[list[str]]:
    """The documents of ``ds`` in batches of ``size`` rows, empty ones dropped (a bounded
    memory whatever the corpus size: datasets reads its Arrow files batch by batch)."""
    require_column(ds, text_field)
    for batch in ds.select_columns([text_field]).iter(batch_size=size):
        docs = [t for t in batch[text_field] if t]
        if docs:
            yield docs


def encode_documents(batches: Iterable[list[str]], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """The token stream of the documents in pieces: documents joined with DOC_SEPARATOR."""
    sep = tokenizer.encode(DOC_SEPARATOR)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    first = True
    for docs in batches:
        if not first:
            yield sep
        first = False
        if encode_batch is None:
            yield tokenizer.encode(DOC_SEPARATOR.join(docs))
            continue
        # Each document on its own (a BPE merge never spans two documents), then joined.
        parts: list[np.ndarray] = []
        for k, ids in enumerate(encode_batch(docs)):
            parts.extend((sep, ids) if k else (ids,))
        yield np.concatenate(parts)


def stream_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint8 for bytes, uint16 up to a
    65,536-id vocabulary (GPT-2's 50,257 fits), uint32 beyond."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size={vocab_size} is not allowed; allowed: at most 2**32")


def tokenize(ds: datasets.Dataset, tokenizer: Tokenizer, text_field: str = "text") -> torch.Tensor:
    """One 1-D token stream in memory: documents joined with DOC_SEPARATOR, empty ones
    skipped (what the token cache writes to disk, cache.py)."""
    require_column(ds, text_field)
    # The smallest dtype that holds every id: a byte corpus of 1 GB stays 1 GB in memory.
    v = tokenizer.vocab_size
    np_dtype = np.uint8 if v <= 256 else np.int16 if v <= 2**15 else np.int32
    parts = list(encode_documents(text_batches(ds, text_field), tokenizer))
    empty = np.zeros(0, dtype=np_dtype)
    return torch.from_numpy(np.concatenate(parts or [empty]).astype(np_dtype, copy=False))


def token_byte_counts(tokenizer: Tokenizer) -> torch.Tensor:
    """int64 [vocab_size]: the UTF-8 bytes of text behind each id (1 each without a
    ``token_bytes`` method: the byte tokenizer's case)."""
    counts = getattr(tokenizer, "token_bytes", None)
    table = counts() if counts is not None else np.ones(tokenizer.vocab_size, dtype=np.int64)
    return torch.as_tensor(np.asarray(table, dtype=np.int64))


def bits_per_byte(loss_nats: float, n_bytes: float = 1.0) -> float:
    """Cross-entropy -> bits per byte: ``loss_nats`` summed over the predicted tokens, divided
    by the UTF-8 bytes of text behind those tokens, in bits. Any tokenizer: sum the loss over
    tokens and ``token_byte_counts()[targets]`` over the same tokens. With the default
    ``n_bytes=1`` a mean loss per token is read as one byte per token (the byte tokenizer).
    """
    return loss_nats / n_bytes / math.log(2)
