"""Snapshots of the last good state, the rollback policy and its remedies.

Trainer-agnostic: the Lightning callback hands in the model, optimizer, scheduler and
scaler, and asks the policy what to do with a ROLLBACK event. The policy is deterministic
host code fed identical numbers on every rank, so all ranks decide the same thing
without talking to each other.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stabilize.io import atomic_torch_save
from stabilize.monitors.events import Event
from stabilize.norms import set_reduction_dtype
from stabilize.validate import check_choice, check_positive, check_range

# retry: restore and go on unchanged (a transient fault - a flipped bit, a bad host - does
# not recur; Megatron-LM re-runs a failing step to tell the two kinds apart).
REMEDIES = ("retry", "skip_data", "lower_lr", "fp32_reduction")


@dataclass
class RollbackConfig:
    enabled: bool = True
    snapshot_every: int = 10  # K: a memory snapshot every K healthy steps
    keep: int = 3  # snapshots in the memory ring
    durable_every: int = 100  # M: also to disk every M steps (0: never)
    durable_async: bool = True  # write to disk on a background thread (DurableWriter)
    margin: int = 1  # restore a snapshot at least this many steps older than the fault
    ladder: list[str] = field(default_factory=lambda: ["skip_data", "lower_lr", "fp32_reduction"])
    skip_batches: int = 20  # skip_data: batches skipped past the restored position
    lr_factor: float = 0.5  # lower_lr: the schedule's LR is multiplied by this
    max_rollbacks: int = 5  # in ``window`` steps, then abort
    window: int = 1000

    def __post_init__(self):
        for k in ("snapshot_every", "keep", "skip_batches", "max_rollbacks", "window"):
            check_positive(f"rollback.{k}", getattr(self, k), integer=True)
        check_range("rollback.durable_every", self.durable_every, 0, float("inf"))
        check_range("rollback.margin", self.margin, 0, float("inf"))
        check_range("rollback.lr_factor", self.lr_factor, 1e-6, 1.0)
        for i, r in enumerate(self.ladder):
            check_choice(f"rollback.ladder[{i}]", r, REMEDIES)


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
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    out = _copy_tree(obj, into, {}, set(), dst, src)
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
    return out


def _copy_tree(obj, into, copies: dict, used: set, dst: list, src: list) -> Any:
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
            out = torch.empty_like(obj, device="cpu")
        dst.append(out)
        src.append(obj.detach())
        copies[key] = out
        return out
    if isinstance(obj, torch.Tensor):  # a subclass (DTensor, ...), sparse: as it comes
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _copy_tree(v, old.get(k), copies, used, dst, src) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _ATOMIC for v in obj):  # a monitor's window: nothing to walk
            return obj if isinstance(obj, tuple) else kind(obj)
        old = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else None
        return kind(
            _copy_tree(v, old[i] if old is not None else None, copies, used, dst, src)
            for i, v in enumerate(obj)
        )
    return copy.deepcopy(obj)


@dataclass
class Snapshot:
    step: int  # the model's step
    state: dict[str, Any]  # everything needed to resume, on the host
    wall: float = field(default_factory=time.time)


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


class DurableWriter:
    """Writes snapshots to disk off the training thread, one at a time, in order.

    A durable write (torch.save + fsync + rename, ``save_durable``) of a 1.3B model and its
    Adam moments is ~21 GB: tens of seconds that a synchronous write takes out of training.
    Here the write runs on one background thread while training goes on; the snapshot's
    host buffers are not touched meanwhile, because the ring only recycles them on a later
    snapshot, and ``_snapshot`` first waits (``busy_with``) when the state it is about to
    overwrite is the one being written. A second write waits for the first, whose error
    (disk full, ...) is raised there, on the training thread; ``wait`` at the end of
    training (and on a crash) means no write is lost. ``background=False``: the write
    happens inside ``submit``, as before.
    """

    def __init__(self, background: bool = True):
        self.background = background
        self._pool = None
        self._pending = None  # (future, state) of the write in flight

    def submit(self, snap: Snapshot, directory: str | Path) -> None:
        self.wait()
        if not self.background:
            save_durable(snap, directory)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="stabilize-durable")
        self._pending = (self._pool.submit(save_durable, snap, directory), snap.state)

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


def load_durable(path: str | Path) -> Snapshot:
    d = torch.load(path, map_location="cpu", weights_only=False)
    return Snapshot(d["step"], d["state"], d["wall"])


@dataclass
class Decision:
    action: str  # "rollback" | "abort"
    snapshot: Snapshot | None = None
    remedy: str | None = None
    reason: str = ""


class RollbackPolicy:
    """Which snapshot, which remedy, or give up.

    Successive rollbacks for the same monitor climb that monitor's ladder: the i-th
    rollback applies ``ladder[i]``; one more than the ladder has rungs, or more than
    ``max_rollbacks`` rollbacks of any kind within ``window`` steps, aborts.
    """

    def __init__(self, cfg: RollbackConfig):
        self.cfg = cfg
        self.history: list[dict[str, Any]] = []  # every rollback so far

    def decide(self, event: Event, ring: SnapshotRing) -> Decision:
        recent = [h for h in self.history if h["fault_step"] > event.step - self.cfg.window]
        same = [h for h in recent if h["monitor"] == event.monitor]  # the ladder resets
        if len(recent) >= self.cfg.max_rollbacks:
            return Decision(
                "abort",
                reason=f"{len(recent)} rollbacks within "
                f"{self.cfg.window} steps (max {self.cfg.max_rollbacks})",
            )
        if len(same) >= len(self.cfg.ladder):
            return Decision(
                "abort",
                reason=f"the remedy ladder {self.cfg.ladder} is exhausted "
                f"for {event.monitor!r}: the fault persists",
            )
        snap = ring.newest_before(event.step - self.cfg.margin)
        if snap is None:
            return Decision(
                "abort",
                reason=f"no snapshot at or before step "
                f"{event.step - self.cfg.margin} (have {ring.steps()})",
            )
        remedy = self.cfg.ladder[len(same)]
        self.history.append(
            {
                "monitor": event.monitor,
                "fault_step": event.step,
                "restored_step": snap.step,
                "remedy": remedy,
                "message": event.message,
                "layer": event.layer,
            }
        )
        return Decision("rollback", snap, remedy)

    def state_dict(self) -> dict:
        return {"history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = copy.deepcopy(state["history"])


def apply_remedy(remedy: str, model: torch.nn.Module, cfg: RollbackConfig) -> dict[str, Any]:
    """Apply one rung; returns what it did (for the event log).

    skip_data (the data position) and lower_lr (the LR scale) are applied by the caller;
    fp32_reduction switches the model's norms here.
    """
    if remedy == "lower_lr":
        return {"lr_factor": cfg.lr_factor}
    if remedy == "fp32_reduction":
        return {"norms_switched": set_reduction_dtype(model, "fp32")}
    if remedy == "skip_data":
        return {"skip_batches": cfg.skip_batches}
    return {}
