"""A token file on disk: written once in pieces with a running checksum, read as a lazily
memory-mapped 1-D array.

Why a memory map: every rank of a node maps the same file, so the tokens sit once in the
page cache, shared, and a rank's own memory does not grow with the corpus. The
array pickles as its path and range, so DataLoader workers map the file too rather than
receiving a copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stabilize.validate import ConfigError

CHUNK = 1 << 24  # 16 MiB reads for the checksum: a fixed buffer, not the page-cached map


def write_tokens(path: Path, pieces: Iterable[np.ndarray], dtype: np.dtype, vocab: int):
    """Append ``pieces`` to ``path`` as ``dtype``; returns (tokens written, crc32). An id
    outside [0, vocab) fails here rather than wrapping around in a narrow dtype."""
    n, crc = 0, 0
    with open(path, "wb") as f:
        for piece in pieces:
            if piece.size and (int(piece.min()) < 0 or int(piece.max()) >= vocab):
                raise ConfigError(
                    f"token ids in [{int(piece.min())}, {int(piece.max())}] do not fit the "
                    f"tokenizer's vocab_size {vocab}; allowed: ids in [0, {vocab - 1}]"
                )
            out = np.ascontiguousarray(piece, dtype=dtype)
            crc = zlib.crc32(out, crc)
            out.tofile(f)
            n += out.size
    return n, crc


def file_crc32(path: Path) -> int:
    """crc32 of a whole file, read in fixed chunks (~1 GB/s; a plain read, so the pages it
    touches are page cache, not this process's resident memory)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class TokenArray:
    """Tokens ``[start, stop)`` of a token file, memory-mapped on first use.

    Duck-types the little of a 1-D tensor that packing.py uses: ``len``, slicing (a view,
    no read), ``dim()`` and ``long()`` (the slice's tokens, read and widened to int64).
    """

    def __init__(self, path: str | Path, dtype: str, start: int = 0, stop: int | None = None):
        self.path, self.dtype = str(path), np.dtype(dtype)
        total = Path(self.path).stat().st_size // self.dtype.itemsize
        self.start, self.stop = start, total if stop is None else stop
        self._map: np.ndarray | None = None

    def array(self) -> np.ndarray:
        """The tokens as a read-only numpy view of the map (nothing is read until indexed)."""
        if self._map is None:
            size = Path(self.path).stat().st_size
            # np.memmap cannot map an empty file
            self._map = (
                np.memmap(self.path, dtype=self.dtype, mode="r")
                if size
                else np.zeros(0, self.dtype)
            )
        return self._map[self.start : self.stop]

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> TokenArray:
        if not isinstance(key, slice):
            raise TypeError(f"a TokenArray takes slices, not {type(key).__name__}")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"a TokenArray slice must be contiguous; got step {step}")
        view = TokenArray.__new__(TokenArray)
        # _map is the whole file's map, shared; start and stop are absolute file positions.
        view.path, view.dtype, view._map = self.path, self.dtype, self._map
        view.start, view.stop = self.start + start, self.start + max(start, stop)
        return view

    def dim(self) -> int:
        return 1

    def long(self) -> torch.Tensor:
        return torch.from_numpy(self.array().astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype.str, "start": self.start, "stop": self.stop}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.dtype = state["path"], np.dtype(state["dtype"])
        self.start, self.stop, self._map = state["start"], state["stop"], None

    def __repr__(self) -> str:
        return f"TokenArray({self.path!r}, {self.dtype}, [{self.start}, {self.stop}))"
