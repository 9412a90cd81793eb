"""Files that a crash cannot tear: checkpoints, snapshots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Write to a temporary file beside ``path``, fsync it, then rename over ``path``.

    A crash (even SIGKILL) at any point leaves either the old file or the new one, never a
    torn one: rename is atomic on POSIX file systems, and the fsyncs order data before name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _remove_orphans(path: Path) -> None:
    """Delete temporaries left by writers that were killed mid-write (their pid is gone)."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass
