"""A repro bundle read as one closed directory: what is loaded is what was verified.

A bundle travels (attached to an issue, sent to a colleague), so every file of it is read
as if a stranger wrote it. Its ``manifest.json`` (stability/bundle.py) lists each file's
size and SHA-256; anyone can recompute those, so the manifest proves the files are whole,
never who wrote them. What this module guarantees on top:

- **closed**: every manifest entry is a plain relative path inside the bundle (no ``..``,
  no absolute path, no symbolic link anywhere on the way), and a file in the bundle that
  the manifest does not list is refused: a file nobody verified never sits beside the
  ones that were;
- **loaded as verified**: ``meta.json``, ``batch.pt`` and ``state.pt`` are read once,
  hashed, and loaded from those same bytes, so the file checked and the file loaded cannot
  differ (a manifest entry naming a copy elsewhere, or a file swapped between the check
  and the load). An FSDP bundle's shard directory is loaded by
  torch.distributed.checkpoint from disk right after each shard is verified;
- **data, not code**: tensors load with ``weights_only=True`` (stabilize/trust.py), and
  ``meta.json`` is checked field by field (``_META``) before anything reads it. Which code
  a foreign model's replay may import is the user's choice on the command line, never the
  bundle's (replay/rebuild.py).

Every refusal is ``BadBundle``: one line naming the file and what is wrong.
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "manifest.json"


class BadBundle(Exception):
    """A bundle that cannot be replayed: missing, damaged, incomplete, incompatible, or not
    closed (a path out of it, a link, a file its manifest does not list)."""


# meta.json's fields that the replay reads, and the types they must have
_NUM = (int, float, type(None))
_META: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "world_size": (int,),
    "precision": (str,),
    "recorded": (dict,),
    "events": (list,),
}
_RECORDED = ("loss", "grad_norm", "loss_scale")
HOST_KINDS = ("gpt", "lightning", "guard", "hf")
FOREIGN = ("lightning", "guard", "hf")  # a model we did not build: rebuilt by replay/rebuild.py


def entry_problem(name: Any) -> str | None:
    """Why a manifest entry's name is not a plain relative path inside the bundle."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        return "is not a relative path"
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("~"):
        return "is an absolute path, outside the bundle"
    if any(part in ("..", ".", "") for part in name.split("/")):
        return "leaves the bundle (a '..' or '.' part)"
    if name == MANIFEST:
        return "is the manifest itself"
    return None


class Bundle:
    """A verified bundle: ``meta`` (checked), ``load(name)`` (from the verified bytes), and
    ``root``. Made by ``open_bundle``."""

    def __init__(self, root: Path, meta: dict[str, Any], blobs: dict[str, bytes]):
        self.root, self.meta, self._blobs = root, meta, blobs

    def __fspath__(self) -> str:
        return str(self.root)

    def load(self, name: str) -> Any:
        """A verified torch file, unpickled with ``weights_only`` from the bytes hashed."""
        import pickle

        import torch

        from stabilize.trust import UntrustedFile, _wanted_global

        if name not in self._blobs:
            raise BadBundle(f"{self.root / name}: not in the bundle's manifest")
        try:
            return torch.load(io.BytesIO(self._blobs[name]), weights_only=True,
                              map_location="cpu")  # fmt: skip
        except pickle.UnpicklingError as e:  # weights_only refused a global: code, not data
            raise UntrustedFile(self.root / name, _wanted_global(str(e))) from None
        except Exception as e:  # a torch zip cut short, not a torch file at all, ...
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise BadBundle(f"{self.root / name}: does not load as a torch file "
                            f"({type(e).__name__}: {first})") from None  # fmt: skip


def _no_link(root: Path, name: str) -> str | None:
    """Why ``root/name`` is not a regular file reached without a symbolic link."""
    here = root
    for part in PurePosixPath(name).parts:
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return "missing"
        if stat.S_ISLNK(st.st_mode):
            return "a symbolic link (a bundle holds its own files)"
    return None if stat.S_ISREG(st.st_mode) else "not a regular file"


def _read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    man = root / MANIFEST
    if not root.is_dir():
        what = "missing" if not root.exists() else "not a directory"
        raise BadBundle(f"{root}: {what} (a bundle is a run's bundles/step-NNNNNN-<monitor> dir)")
    if os.path.islink(man) or not man.is_file():
        raise BadBundle(f"{man}: missing (not a bundle, or an incomplete one)")
    from stabilize.stability.bundle import READS

    try:
        manifest = json.loads(man.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadBundle(f"{man}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READS:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise BadBundle(f"{man}: bundle format {got!r}; this version reads "
                        f"{' and '.join(map(str, READS))}")  # fmt: skip
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise BadBundle(f"{man}: 'files' must map each file of the bundle to its size and SHA-256")
    for name, want in files.items():
        why = entry_problem(name)
        if why is not None:
            raise BadBundle(f"{man}: the entry {name!r} {why}; a bundle is one closed directory")
        ok = isinstance(want, dict) and type(want.get("bytes")) is int and \
            isinstance(want.get("sha256"), str)  # fmt: skip
        if not ok:
            raise BadBundle(f"{man}: the entry {name!r} must hold 'bytes' and 'sha256'")
    return files


def _unlisted(root: Path, files: dict) -> list[str]:
    """Files (and links) in the bundle that its manifest does not list."""
    found = []
    for dirpath, dirnames, names in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for n in names + [d for d in dirnames if os.path.islink(Path(dirpath, d))]:
            name = (rel / n).as_posix()
            if name != MANIFEST and name not in files:
                found.append(name)
    return sorted(found)


def open_bundle(path: str | os.PathLike) -> Bundle:
    """The bundle at ``path``, every file checked against its manifest; else ``BadBundle``."""
    import hashlib

    from stabilize.stability.bundle import sha256

    root = Path(path)
    files = _read_manifest(root)
    extra = _unlisted(root, files)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise BadBundle(f"{root / extra[0]}{more}: not listed in the manifest; a bundle holds "
                        "only the files its manifest lists (remove it, or write the bundle "
                        "again)")  # fmt: skip
    for need in ("meta.json", "batch.pt"):
        if need not in files:
            raise BadBundle(f"{root / MANIFEST}: lists no {need}")
    blobs: dict[str, bytes] = {}
    for name, want in files.items():
        f = root / name
        why = _no_link(root, name)
        if why is not None:
            raise BadBundle(f"{f}: {why}")
        if f.stat().st_size != want["bytes"]:
            raise BadBundle(f"{f}: {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        if "/" in name:  # the state/ shards: read by DCP from disk, hashed as a stream
            digest = sha256(f)
        else:  # read once: the bytes hashed are the bytes loaded (BytesIO shares them)
            blobs[name] = f.read_bytes()
            digest = hashlib.sha256(blobs[name]).hexdigest()
        if digest != want["sha256"]:
            raise BadBundle(f"{f}: damaged (its SHA-256 is not the manifest's)")
    meta = _meta(root, blobs["meta.json"])
    if meta.get("state_omitted"):
        raise BadBundle(f"{root / 'state.pt'}: not in the bundle ({meta['state_omitted']})")
    need = "state/.metadata" if meta.get("state_sharded") else "state.pt"
    if need not in files:
        raise BadBundle(f"{root / MANIFEST}: lists no {need}")
    return Bundle(root, meta, blobs)


def _meta(root: Path, raw: bytes) -> dict[str, Any]:
    """``meta.json``, every field the replay reads of the type it must have."""
    where = root / "meta.json"
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadBundle(f"{where}: not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise BadBundle(f"{where}: must be a JSON object")
    for key, types in _META.items():
        v = meta.get(key)
        if not isinstance(v, types) or isinstance(v, bool):
            raise BadBundle(
                f"{where}: {key!r} is {v!r}; must be {' or '.join(t.__name__ for t in types)}"
            )
    if meta["world_size"] < 1 or meta["step"] < 0:
        raise BadBundle(
            f"{where}: step {meta['step']} / world_size {meta['world_size']} out of range"
        )
    for key in _RECORDED:
        v = meta["recorded"].get(key)
        if not isinstance(v, _NUM) or isinstance(v, bool):
            raise BadBundle(f"{where}: recorded.{key} is {v!r}; must be a number or null")
    if not all(isinstance(e, dict) and isinstance(e.get("monitor"), str) for e in meta["events"]):
        raise BadBundle(f"{where}: 'events' must be a list of events, each naming its monitor")
    host = meta.get("host", {"kind": "gpt"})
    if not isinstance(host, dict) or host.get("kind") not in HOST_KINDS:
        kind = host.get("kind") if isinstance(host, dict) else host
        raise BadBundle(f"{where}: host.kind is {kind!r}; allowed: {', '.join(HOST_KINDS)}")
    if host["kind"] == "gpt" and not isinstance(meta.get("config"), dict):
        raise BadBundle(f"{where}: 'config' must be the run's config (a JSON object)")
    return meta
