"""Snapshots of the last good state: host copies, the memory ring and durable writes.

Trainer-agnostic: the rollback controller (stabilize/stability/controller.py) hands in
the state dicts of the model, optimizer, scheduler and scaler.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from stabilize.compat import dtensor_local, foreach_copy_
from stabilize.io import atomic_torch_save, verified_load

_ATOMIC = (int, float, bool, str, bytes, type(None))


def to_cpu(obj: Any, into: Any = None) -> Any:
    """A deep copy with every tensor copied to host memory (snapshots outlive the step).

    ``into``: an earlier copy of the same structure (a snapshot that left the ring): a
    tensor whose counterpart there has the same shape and dtype is written into it
    instead of a new allocation (no allocation, no page faults: the ring reuses its
    buffers). Whatever does not match is allocated afresh; non-tensors are always copied
    anew, never mutated in place. A tensor that appears twice (a tied weight under two
    names in a state dict) is copied once and shared, as torch.save would. The copies are
    made by one ``torch._foreach_copy_`` (one dispatch, not one per tensor).
    """
    out, dst, src = to_cpu_deferred(obj, into)
    if dst:
        with torch.no_grad():
            foreach_copy_(dst, src)
    return out


def to_cpu_deferred(obj: Any, into: Any = None, pin: bool = False):
    """``to_cpu``'s host structure now and its copies left to the caller: ``(tree, dst,
    src)``, the tree's host tensors not yet written (``foreach_copy_(dst, src)`` fills
    them, on whatever thread or stream). ``pin``: new host buffers are pinned (a CUDA
    source copied with ``non_blocking``)."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    return _copy_tree(obj, into, {}, set(), dst, src, pin), dst, src


def optimizer_written(optimizer) -> set[int]:
    """The data pointers of what only ``optimizer.step`` writes: its parameters and every
    tensor of its state (moments, step counters)."""
    ptrs = {p.data_ptr() for g in optimizer.param_groups for p in g["params"]}
    for st in optimizer.state.values():
        ptrs.update(t.data_ptr() for t in st.values() if isinstance(t, torch.Tensor))
    return ptrs


def copy_split(parts: dict[str, Any], old: dict, late: set[int], copier) -> dict[str, Any]:
    """``{name: to_cpu(part)}``, the host tensors whose source's data pointer is in ``late``
    (``optimizer_written``: the next forward and backward only read them) copied by
    ``copier`` (``copy(dst, src)`` on a thread, which waits for its previous copy first;
    ``fence()`` before anything writes them), the rest now: buffers a forward may write (running
    statistics, amax histories) are never copied late."""
    trees, now, later = {}, ([], []), ([], [])
    for k, v in parts.items():
        trees[k], dst, src = to_cpu_deferred(v, old.get(k))
        for d, s in zip(dst, src, strict=True):
            to = later if s.is_cpu and s.data_ptr() in late else now
            to[0].append(d)
            to[1].append(s)
    if now[0]:
        with torch.no_grad():
            foreach_copy_(*now)
    if later[0]:
        copier.copy(*later)
    return trees


def _copy_tree(obj, into, copies: dict, used: set, dst: list, src: list, pin=False) -> Any:
    """to_cpu's walk: the structure now, the tensor copies queued in (dst, src)."""
    kind = type(obj)
    if kind in _ATOMIC:
        return obj
    if (kind is torch.Tensor or kind is torch.nn.Parameter) and obj.layout == torch.strided:
        key = (obj.device, obj.data_ptr(), obj.dtype, obj.shape, obj.stride())
        out = copies.get(key)
        if out is not None:
            return out
        if (
            type(into) is torch.Tensor
            and into.device.type == "cpu"
            and into.shape == obj.shape
            and into.dtype == obj.dtype
            and id(into) not in used  # shared in the old copy but not in this one
        ):
            out = into
            used.add(id(into))
        else:
            out = torch.empty_like(obj, device="cpu", pin_memory=pin)
        dst.append(out)
        src.append(obj.detach())
        copies[key] = out
        return out
    local = dtensor_local(obj)  # a DTensor (FSDP2): this rank's shard
    if local is not None:
        old = dtensor_local(into)
        if (
            old is not None
            and old.device.type == "cpu"
            and old.shape == local.shape
            and old.dtype == local.dtype
            and into.placements == obj.placements
            and id(into) not in used
        ):  # the shard written into the recycled one's buffer: no allocation
            used.add(id(into))
            dst.append(old)
            src.append(local.detach())
            return into
    if isinstance(obj, torch.Tensor):  # a subclass (DTensor, ...), sparse: as it comes
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _copy_tree(v, old.get(k), copies, used, dst, src, pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _ATOMIC for v in obj):  # a monitor's window: nothing to walk
            return obj if isinstance(obj, tuple) else kind(obj)
        old = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else None
        return kind(
            _copy_tree(v, old[i] if old is not None else None, copies, used, dst, src, pin)
            for i, v in enumerate(obj)
        )
    return copy.deepcopy(obj)


class Snapshot:
    """One snapshot: the model's ``step``, ``state`` (everything needed to resume, on the
    host), its ``wall`` time. ``landed``: waits for a host copy still in flight
    (``copy_split``), called before the state is first read: no reader sees it half-copied."""

    def __init__(self, step: int, state: dict[str, Any], wall: float | None = None,
                 landed=None):  # fmt: skip
        self.step, self._state, self._landed = step, state, landed
        self.wall = time.time() if wall is None else wall

    @property
    def state(self) -> dict[str, Any]:
        if self._landed is not None:
            self._landed()
            self._landed = None
        return self._state


class SnapshotRing:
    """The newest ``keep`` snapshots. Their host buffers are recycled: the snapshot that
    leaves the ring (the oldest, or those a rollback drops) lends its tensors to the next
    one (``to_cpu(..., into=)``), so a run allocates snapshot memory ``keep`` (+1) times,
    not every K steps. Each snapshot in the ring owns its own buffers."""

    def __init__(self, keep: int):
        self.ring: deque[Snapshot] = deque(maxlen=keep)
        self.spare: list[dict[str, Any]] = []  # states of snapshots no longer in the ring

    def recycle(self) -> dict[str, Any] | None:
        """A state whose tensors the next snapshot may overwrite, or None (allocate).

        When the ring is full its oldest snapshot leaves now, before the copy: a copy that
        fails half-way then costs that snapshot, never corrupts one still in the ring."""
        if self.spare:
            return self.spare.pop()
        if len(self.ring) == self.ring.maxlen:
            return self.ring.popleft().state
        return None

    def push(self, snap: Snapshot) -> None:
        self.ring.append(snap)

    def drop_after(self, step: int) -> None:
        """Forget the snapshots newer than ``step`` (a rollback to it); keep their buffers."""
        keep = [s for s in self.ring if s.step <= step]
        self.spare += [s.state for s in self.ring if s.step > step]
        self.ring = deque(keep, maxlen=self.ring.maxlen)

    def newest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot whose step is <= ``step``."""
        ok = [s for s in self.ring if s.step <= step]
        return ok[-1] if ok else None

    def steps(self) -> list[int]:
        return [s.step for s in self.ring]


def save_durable(snap: Snapshot, directory: str | Path) -> Path:
    path = Path(directory) / f"snapshot-{snap.step:06d}.pt"
    atomic_torch_save({"step": snap.step, "state": snap.state, "wall": snap.wall}, path)
    return path


def save_and_prune(snap: Snapshot, directory: str | Path, keep: int = -1) -> Path:
    """``save_durable``, then keep only the newest ``keep`` snapshot files in ``directory``
    (-1: all), so that disk use stays bounded (``rollback.keep_durable``)."""
    path = save_durable(snap, directory)
    if keep > 0:
        prune_durable(directory, keep)
    return path


def prune_durable(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` durable snapshots in ``directory`` (by step: the
    zero-padded names sort by it); the paths deleted. After a rollback the files of steps
    past the restored one are still there until the same steps are written again: they
    count as the newest, and are replaced in place."""
    files = sorted(Path(directory).glob("snapshot-*.pt"))
    old = files[: max(0, len(files) - keep)]
    for f in old:
        f.unlink(missing_ok=True)
    return old


class DurableWriter:
    """Writes snapshots to disk off the training thread, one at a time, in order.

    A durable write (torch.save + fsync + rename, ``save_durable``) of a 1.3B model and its
    Adam moments is ~16 GB (12 bytes a parameter: docs/memory.md): seconds to tens of
    seconds that a synchronous write takes out of training.
    Here the write runs on one background thread while training goes on; the snapshot's
    host buffers are not touched meanwhile, because the ring only recycles them on a later
    snapshot, and ``_snapshot`` first waits (``busy_with``) when the state it is about to
    overwrite is the one being written. A second write waits for the first, whose error
    (disk full, ...) is raised there, on the training thread; ``wait`` at the end of
    training (and on a crash) means no write is lost. ``background=False``: the write
    happens inside ``submit``, as before. ``keep``: snapshot files kept in the directory
    after each write (``rollback.keep_durable``; -1: all).
    """

    def __init__(self, background: bool = True, keep: int = -1):
        self.background = background
        self.keep = keep
        self._pool = None
        self._pending = None  # (future, state) of the write in flight

    def submit(self, snap: Snapshot, directory: str | Path, ready=None) -> None:
        """``ready``: called first, on the writer's thread (the snapshot's host copy may
        still be in flight: it waits for it)."""
        self.wait()
        if not self.background:
            if ready is not None:
                ready()
            save_and_prune(snap, directory, self.keep)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="stabilize-durable")
        job = self._pool.submit(_ready_then_save, ready, snap, directory, self.keep)
        self._pending = (job, snap.state)

    def busy_with(self, state: Any) -> bool:
        """Is ``state`` (a snapshot's state dict) being written right now?"""
        return self._pending is not None and self._pending[1] is state

    def wait(self) -> Path | None:
        """Block until the write in flight is on disk; its path (None: nothing in flight).
        Raises the write's own error."""
        if self._pending is None:
            return None
        future, _ = self._pending
        self._pending = None
        return future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _ready_then_save(ready, snap: Snapshot, directory, keep: int) -> Path:
    if ready is not None:
        ready()
    return save_and_prune(snap, directory, keep)


def load_durable(path: str | Path) -> Snapshot:
    """A durable snapshot, its checksum verified (``stabilize.io.DamagedFile`` names a
    damaged file; one written before checksums loads unverified)."""
    d = verified_load(path)
    return Snapshot(d["step"], d["state"], d["wall"])
