"""Loading files that may come from someone else, without running their code.

A checkpoint is a pickle, and unpickling can call any function the file names: a file
passed around a cluster, or swapped into a run dir, could run a command on load. A
checksum (``stabilize.io``) tells a damaged file from an intact one; it vouches for
nothing about who wrote it. So every checkpoint, snapshot and sharded-checkpoint index is
loaded here the safe way:

- ``torch.load(..., weights_only=True)``: tensors, plain containers and numbers only. Our
  own state needs nothing more (``lit/saved_state.py`` and ``RunConfig.to_dict`` hold plain
  types; tests/test_trust.py loads a real checkpoint, snapshot and sharded checkpoint so);
- a DCP (FSDP) directory's ``.metadata``, which torch.distributed.checkpoint reads with
  plain ``pickle.load``, is first unpickled by ``check_dcp_index`` with a fixed allow-list
  of DCP's own metadata classes.

A file that needs anything else is refused with ``UntrustedFile`` (one line: the file, the
global it asked for). ``resume_trusted=true`` loads a resume checkpoint the old way, for a
file you wrote yourself with other code in it.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

TRUST_HINT = (
    "unpickling it could run code; allowed: a checkpoint that loads with weights_only=True "
    "(every one stabilize-train writes), or resume_trusted=true for a file you trust"
)

# What DCP's .metadata index may name: its own dataclasses, and the torch and pathlib types
# they hold. Anything else (os.system, subprocess.*, builtins.eval, ...) is refused.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_DCP_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UntrustedFile(ValueError):
    """A file that would need pickle's full power to load: refused, nothing of it ran."""

    def __init__(self, path: str | os.PathLike, wants: str):
        self.path, self.wants = str(path), wants
        self.reason = f"it needs {wants} to load, and {TRUST_HINT}"
        super().__init__(f"{path} is refused: {self.reason}")


def torch_load(path: str | os.PathLike, trusted: bool = False, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless ``trusted``; a file that needs more
    raises ``UntrustedFile`` naming it and the global it asked for."""
    import torch

    try:
        return torch.load(path, weights_only=not trusted, **kwargs)
    except pickle.UnpicklingError as e:
        if trusted:
            raise
        raise UntrustedFile(path, _wanted_global(str(e))) from None


def _wanted_global(message: str) -> str:
    """The global named in torch's weights_only refusal ("Unsupported global: GLOBAL
    posix.system ..."), else what its first line says."""
    m = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"global ([\w.]+)", message)
    if m:
        return f"the global {m.group(1)}"
    return "more than weights_only allows (" + message.splitlines()[0][:120] + ")"


class _DcpIndexUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _DCP_NAMES or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UntrustedFile(self.path, f"the global {module}.{name}")


def _is_dtype(module: str, name: str) -> bool:
    import torch

    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def check_dcp_index(directory: str | os.PathLike, trusted: bool = False) -> None:
    """A sharded checkpoint's ``.metadata`` unpickled with the allow-list above before
    torch.distributed.checkpoint unpickles it without one; ``UntrustedFile`` if it names
    anything else. A missing index is left to the caller (a damaged checkpoint)."""
    index = Path(directory) / ".metadata"
    if trusted or not index.is_file():
        return
    with index.open("rb") as f:
        try:
            _DcpIndexUnpickler(f, index).load()
        except UntrustedFile:
            raise
        except Exception as e:  # not a readable pickle: damaged, not a trust question
            from stabilize.io import DamagedFile

            raise DamagedFile(f"{index} does not load: {type(e).__name__}: {e}") from None
