"""A token stream cut into next-token blocks, and the contiguous train/val split.

PackedBlocks makes item i a pure function of i, so the sampler (sampler.py) decides the whole
order; StepTagged carries each item's data step so a consumer can tell a stale prefetch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.utils.data import Dataset

from stabilize.data.token_file import TokenArray
from stabilize.validate import check_positive, check_range


class PackedBlocks(Dataset):
    """Item i: x = stream[i*T : i*T+T], y = stream[i*T+1 : i*T+T+1] (next-token targets).

    Windows of T+1 tokens that share only their boundary token, so every token is a target
    once per epoch; int64 because that is what embedding lookups and cross_entropy take. The
    stream is a tensor or a memory-mapped TokenArray (only the window is read).
    """

    def __init__(
        self,
        stream: torch.Tensor | TokenArray,
        block_size: int,
        token_bytes: torch.Tensor | None = None,
    ) -> None:
        check_positive("block_size", block_size, integer=True)
        if stream.dim() != 1:
            raise ValueError(f"stream must be 1-D; got shape {tuple(stream.shape)}")
        self.stream, self.block_size = stream, block_size
        self.token_bytes = token_bytes
        """int64 [vocab]: the UTF-8 bytes behind each id, for bits per byte (None: one each)."""

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range [0, {len(self)})")
        s, t = self.stream, self.block_size
        return s[i * t : i * t + t].long(), s[i * t + 1 : i * t + t + 1].long()

    def item_hash(self, i: int) -> str:
        """Item i's content hash (``block_hash``)."""
        return block_hash(*self[i])


def block_hash(x: torch.Tensor, y: torch.Tensor) -> str:
    """A block's content hash: SHA-256 of its T+1 token ids (x, then y's last) as int64
    little-endian, its first 16 hex digits. It names a sequence across runs: the block index
    alone moves with the corpus, the tokenizer and block_size."""
    ids = torch.cat([x.reshape(-1), y.reshape(-1)[-1:]]).to(torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()[:16]


class StepTagged(Dataset):
    """Items addressed as (step, i): returns the wrapped item plus its data step."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        step, i = key
        return (*self.dataset[i], step)


def split_stream(stream: torch.Tensor | TokenArray, val_fraction: float) -> tuple[Any, Any]:
    """Train = the head, val = the last val_fraction: contiguous, so no block straddles both."""
    check_range("data.val_fraction", val_fraction, 0.0, 0.5)
    n_val = int(len(stream) * val_fraction)
    cut = len(stream) - n_val
    return stream[:cut], stream[cut:]
