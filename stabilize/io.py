"""Files that a crash cannot tear and that prove themselves: checkpoints, snapshots.

Every file written by ``atomic_torch_save`` ends with a checksum footer: the SHA-256 of
everything before it, in one fixed-length line. The footer travels with the file (a ``cp``
or ``mv`` of one file keeps it) and lands with it in the same rename, so no crash can
leave a file and a checksum that disagree. Zip readers, ``torch.load`` among them, find an
archive's directory by searching back from the end, so trailing bytes are ignored and a
plain ``torch.load`` of these files still works (tests/test_rundir.py checks it).

``verify`` / ``verified_load`` tell an intact file from a damaged one (flipped bytes,
truncated, empty, not a checkpoint at all) with one line that names the file; a file
without a footer (written before the footer existed) is checked as far as its format
allows (the zip archive's own CRC-32 of every record) and reported as unverified.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

FOOTER_TAG = b"\n#stabilize-sha256:"
FOOTER_LEN = len(FOOTER_TAG) + 64 + 1  # tag, 64 hex digits, newline
_CHUNK = 1 << 23


class DamagedFile(ValueError):
    """A checkpoint or snapshot that is not what was written: the message names the file."""


class _HashingWriter:
    """Hands torch.save's bytes to the file and to SHA-256 at once (no second read), and
    keeps the first write error: torch's zip writer replaces it with an errno-less
    ``RuntimeError: ... unexpected pos N vs M``."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` to ``path`` whole or not at all: a hidden temp file beside it, renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Write to a temporary file beside ``path`` (with its checksum footer), fsync it, then
    rename over ``path``.

    A crash (even SIGKILL) at any point leaves either the old file or the new one, never a
    torn one: rename is atomic on POSIX file systems, and the fsyncs order data before name.
    A failed write (a full disk: ENOSPC, a file-size limit: EFBIG) raises the OS's
    ``OSError`` with ``filename`` set to ``path``; ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            w = _HashingWriter(f)
            try:
                torch.save(obj, w)
            except RuntimeError:
                if w.error is None:
                    raise
                raise w.error from None  # the OS's reason (a full disk), not the zip writer's
            f.write(FOOTER_TAG + w.sha.hexdigest().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None:  # a failed write or fsync names no file: say which one
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def stored_checksum(path: str | os.PathLike) -> str | None:
    """The SHA-256 recorded in ``path``'s footer; None when it has no footer."""
    size = os.path.getsize(path)
    if size < FOOTER_LEN:
        return None
    with open(path, "rb") as f:
        f.seek(size - FOOTER_LEN)
        tail = f.read(FOOTER_LEN)
    if not tail.startswith(FOOTER_TAG) or not tail.endswith(b"\n"):
        return None
    digest = tail[len(FOOTER_TAG) : -1].decode("ascii", "replace")
    return digest if all(c in "0123456789abcdef" for c in digest) else None


def body_checksum(path: str | os.PathLike) -> str:
    """SHA-256 of ``path`` without its footer (of the whole file when it has none)."""
    size = os.path.getsize(path)
    n = size - FOOTER_LEN if stored_checksum(path) is not None else size
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while n > 0:
            chunk = f.read(min(_CHUNK, n))
            if not chunk:
                break
            sha.update(chunk)
            n -= len(chunk)
    return sha.hexdigest()


def verify(path: str | os.PathLike) -> bool:
    """True: ``path`` is exactly what was written (its checksum matches). False: it has no
    checksum (an older file) but is a whole archive whose records pass their CRC-32.
    Raises ``DamagedFile`` (one line naming the file and what is wrong) otherwise, and
    ``FileNotFoundError`` when there is no such file."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise DamagedFile(f"{path} is empty (0 bytes)")
    want = stored_checksum(path)
    if want is not None:
        got = body_checksum(path)
        if got != want:
            raise DamagedFile(
                f"{path} is damaged: its SHA-256 is {got[:12]}..., written as {want[:12]}..."
            )
        return True
    try:  # no footer: an older file, or one cut short (truncation takes the footer first)
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise DamagedFile(
            f"{path} is not a whole checkpoint ({size} bytes, no checksum, and not a readable "
            f"archive: {e})"
        ) from None
    if bad is not None:
        raise DamagedFile(f"{path} is damaged: its record {bad!r} fails its CRC-32")
    return False


def verified_load(path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """``torch.load`` of a file that ``verify`` accepts; ``DamagedFile`` for one it does not,
    or one that does not unpickle. ``kwargs`` go to ``torch.load`` (default
    ``weights_only=True``: a file that needs more does not load, stabilize/trust.py).

    An unverified file (no checksum) loads; callers that want to say so call ``verify``
    first (it returns False for such a file)."""
    verify(path)
    kwargs.setdefault("weights_only", True)
    try:
        return torch.load(path, map_location=map_location, **kwargs)
    except Exception as e:  # a pickle that a checksum cannot vouch for (an older file)
        raise DamagedFile(f"{path} does not load: {type(e).__name__}: {e}") from None


def _remove_orphans(path: Path) -> None:
    """Delete temporaries left by writers that were killed mid-write (their pid is gone)."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            os.kill(int(tmp.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass
