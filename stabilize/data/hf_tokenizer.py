"""Hugging Face ``tokenizers`` behind the data package's Tokenizer protocol: a byte-level BPE
trained on the corpus, or one loaded from a ``tokenizer.json`` / a ``transformers`` directory /
the hub.

Why HF ``tokenizers`` (a runtime dependency, imported lazily): it trains a byte-level BPE on
~500 KB in about a second, encodes a batch of documents on every core (Rust threads, so no
process pool and no pickling), and reads the ``tokenizer.json`` that ``transformers`` saves
beside every fast tokenizer. Byte-level (GPT-2's scheme): every string is encodable, no
unknown token, and each id stands for a fixed run of bytes, which makes bits per byte exact.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Bump when train_bpe's recipe changes: trained tokenizers (and their token caches) rebuild.
BPE_RECIPE = 1


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the 188 printable bytes stand for
    themselves and the other 68 are moved to code points from 256 up, so every byte is one
    visible character (Radford et al. 2019; HF ByteLevel uses the same table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` as the data package's Tokenizer (ids as numpy arrays)."""

    def __init__(self, tok: Any, source: str) -> None:
        self.tok, self.source = tok, source
        vocab = tok.get_vocab(with_added_tokens=True)
        # Ids are in [0, vocab_size): the largest id + 1, should the ids have gaps.
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, seq: Any) -> str:
        if isinstance(seq, torch.Tensor):
            seq = seq.detach().cpu()
        return self.tok.decode([int(i) for i in seq], skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes behind each id. Byte-level vocabularies: the length of the token's
        byte string, exact. Special tokens: 0 (they stand for no text). Other schemes
        (SentencePiece, WordPiece): the bytes of the id decoded alone, the best a per-id
        table can do there (docs/data.md)."""
        out = np.zeros(self.vocab_size, dtype=np.int64)
        alphabet = byte_level_alphabet()
        byte_level = json.loads(self.tok.to_str()).get("decoder", {}) or {}
        byte_level = byte_level.get("type") == "ByteLevel"
        added = self.tok.get_added_tokens_decoder()
        for text, i in self.tok.get_vocab(with_added_tokens=True).items():
            if i in added:
                out[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            elif byte_level and all(c in alphabet for c in text):
                out[i] = len(text)  # one character per byte
            else:
                out[i] = len(self.tok.decode([i]).encode("utf-8"))
        return out

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


def train_bpe(texts: Any, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts`` (an iterable of
    lists of documents). Deterministic: the same texts give the same merges (the trainer
    breaks count ties by the pair itself). No special tokens: documents are separated by
    DOC_SEPARATOR's own tokens, as with bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, f"bpe(vocab_size={vocab_size})")


def tokenizer_file(path: Path) -> Path | None:
    """The ``tokenizer.json`` behind a path: the file itself, or the one a ``transformers``
    fast tokenizer saves into its directory (``save_pretrained``); None if there is none."""
    if path.is_file():
        return path
    candidate = path / "tokenizer.json"
    return candidate if candidate.is_file() else None


def load_file(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_file(str(path)), str(path))


def load_hub(name: str) -> HFTokenizer:
    """A tokenizer by hub name (downloads its tokenizer.json; online only)."""
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_pretrained(name), name)
