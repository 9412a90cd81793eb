"""One copy of each snapshot per world, not per rank.

Under DDP every rank holds the same weights and AdamW moments, so a full snapshot on every
rank is ``world`` identical copies (for gpt-1.3b at keep=3: 47 GB per rank, 379 GB per
8-GPU node). Here each rank keeps only its 1/world slice of the flattened state:

- the state's tensors are laid end to end in one flat buffer per dtype (``Layout``; a tensor
  seen twice, a tied weight, is laid once), padded to a multiple of ``world``;
- rank r copies elements [r * chunk, (r + 1) * chunk) of each flat buffer into host memory
  (``ShardedState.capture``; only the pieces of the tensors that overlap its range, so each
  rank copies 1/world of the bytes, and nothing is flattened on the device);
- a restore rebuilds the whole on every rank by one ``all_gather_into_tensor`` per dtype,
  then views the gathered buffer back into the state's structure (``ShardedState.gather``).

On CUDA the slices are pinned host buffers filled on a side stream (``_CudaCopy``): the
copy overlaps the next step's forward and backward, and the next optimizer step (the first
thing that writes the parameters and moments) waits for it on the device, with no host
sync. On CPU the same code copies synchronously. A world of one keeps the full copy; on the
host what only the optimizer step writes is copied on a thread (``copy_split``).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stabilize.compat import foreach_copy_
from stabilize.rollback.snapshots import Snapshot, copy_split, optimizer_written, to_cpu_deferred

_ATOMIC = (int, float, bool, str, bytes, type(None))


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a skeleton: its index in ``Layout.pieces``."""

    index: int


@dataclass(frozen=True)
class _Piece:
    dtype: torch.dtype
    offset: int  # in the flat buffer of its dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class Layout:
    """Where each tensor of a state tree lies in the flat buffer of its dtype."""

    def __init__(self, tree: Any):
        self.tensors: list[torch.Tensor] = []
        self.pieces: list[_Piece] = []
        self.sizes: dict[torch.dtype, int] = {}
        self.skeleton = self._walk(tree, {})

    def _walk(self, obj, seen: dict) -> Any:
        kind = type(obj)
        if kind in _ATOMIC:
            return obj
        if isinstance(obj, torch.Tensor):
            key = (obj.device, obj.data_ptr(), obj.dtype, obj.shape, obj.stride())
            if key not in seen:
                off = self.sizes.get(obj.dtype, 0)
                self.sizes[obj.dtype] = off + obj.numel()
                seen[key] = _Slot(len(self.pieces))
                self.pieces.append(_Piece(obj.dtype, off, tuple(obj.shape)))
                self.tensors.append(obj.detach())
            return seen[key]
        if isinstance(obj, dict):
            return {k: self._walk(v, seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return kind(self._walk(v, seen) for v in obj)
        return copy.deepcopy(obj)

    def chunk(self, dtype: torch.dtype, world: int) -> int:
        """Elements of ``dtype`` per rank: the flat buffer padded to a multiple of world."""
        return -(-self.sizes[dtype] // world)


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


class _CudaCopy:
    """Device -> pinned host copies on a side stream, fenced before the next optimizer step.

    Only built when a snapshot's tensors are on CUDA; nothing here runs on a CPU machine."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.event: torch.cuda.Event | None = None
        self._hooked: set[int] = set()

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())  # the step's writes are done
        with torch.cuda.stream(self.stream), torch.no_grad():
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
                if s.is_cuda:
                    s.record_stream(self.stream)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def fence(self, *_: Any) -> None:
        """The compute stream waits (on the device) for the copy in flight, if any."""
        event = self.event  # read once: the durable writer's thread may wait on it too
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait(self) -> None:
        """The host waits for the copy (before it reads the pinned buffers)."""
        event = self.event
        if event is not None:
            event.synchronize()

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence every later ``optimizer.step``: it writes the tensors being copied."""
        if id(optimizer) not in self._hooked:
            optimizer.register_step_pre_hook(self.fence)
            self._hooked.add(id(optimizer))


class _ThreadCopy:
    """The same contract on the host: the copy runs on a thread of its own (torch's copy
    kernels release the GIL, so the next step's forward and backward go on meanwhile), and
    ``fence`` - before anything that writes the tensors being copied - waits for it."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._hooked: set[int] = set()
        self._lock = threading.Lock()

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        self.fence()

        def run():
            try:
                with torch.no_grad():
                    foreach_copy_(dst, src)
            except BaseException as e:  # raised by fence, on the thread that waits
                self._error = e

        self._thread = threading.Thread(target=run, name="stabilize-durable-copy", daemon=True)
        self._thread.start()

    def fence(self, *_: Any) -> None:
        # the durable writer's thread fences too: clear only the copy it waited for
        t = self._thread
        if t is not None:
            t.join()
            with self._lock:
                if self._thread is t:
                    self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    wait = fence

    guard = _CudaCopy.guard


class ShardedState:
    """This rank's slice of a flattened state tree, plus the tree's skeleton."""

    def __init__(self, layout: Layout, rank: int, world: int, slices: dict):
        self.skeleton, self.pieces, self.sizes = layout.skeleton, layout.pieces, layout.sizes
        self.rank, self.world = rank, world
        self.slices: dict[torch.dtype, torch.Tensor] = slices  # [chunk] per dtype, host
        self.cuda: _CudaCopy | None = None  # set when the copy is in flight on a side stream

    @classmethod
    def capture(
        cls,
        tree: Any,
        rank: int,
        world: int,
        into: ShardedState | None = None,
        cuda: _CudaCopy | None = None,
    ) -> ShardedState:
        """Copy this rank's slice of ``tree``'s tensors to the host. ``tree``: a state tree
        or its ``Layout``. ``into``: a state that left the ring, whose slices are reused
        when their dtype and length match. ``cuda``: the side-stream copier, for device
        tensors (the copy is then still in flight)."""
        lay = tree if isinstance(tree, Layout) else Layout(tree)
        old = into.slices if into is not None else {}
        pin = cuda is not None
        slices, dst, src = {}, [], []
        for dtype in lay.sizes:
            n = lay.chunk(dtype, world)
            buf = old.get(dtype)
            if buf is None or buf.numel() != n or buf.is_pinned() != pin:
                buf = torch.empty(n, dtype=dtype, pin_memory=pin)
            slices[dtype] = buf
        for t, p in zip(lay.tensors, lay.pieces, strict=True):
            n = lay.chunk(p.dtype, world)
            lo, hi = rank * n, (rank + 1) * n
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:  # this tensor's elements [a, b) of the flat buffer are ours
                dst.append(slices[p.dtype][a - lo : b - lo])
                src.append(t.reshape(-1)[a - p.offset : b - p.offset])  # [numel] view
        out = cls(lay, rank, world, slices)
        if cuda is not None:
            cuda.copy(dst, src)
            out.cuda = cuda
        elif dst:
            with torch.no_grad():
                foreach_copy_(dst, src)
        return out

    def ready(self) -> None:
        """Wait for a side-stream copy still in flight (CUDA only)."""
        if self.cuda is not None:
            self.cuda.wait()
            self.cuda = None

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slices.values())

    def gather(self, device: torch.device | str | None = None) -> Any:
        """The whole state tree, rebuilt on every rank by one all-gather per dtype (a
        collective: every rank calls it together). Tensors are views into one fresh buffer
        per dtype on ``device`` (default: where the process group's backend gathers)."""
        self.ready()
        if device is None:
            device = _collective_device()
        full: dict[torch.dtype, torch.Tensor] = {}
        for dtype, mine in self.slices.items():
            n = mine.numel()
            buf = torch.empty(n * self.world, dtype=dtype, device=device)  # [world * chunk]
            if self.world == 1:
                buf.copy_(mine)
            else:
                dist.all_gather_into_tensor(buf, mine.to(device))
            full[dtype] = buf
        tensors = [full[p.dtype][p.offset : p.offset + p.numel].view(p.shape) for p in self.pieces]
        return _fill(self.skeleton, tensors)


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


SHARD = "shard"  # the key of the sharded part in a snapshot's state


class Sharder:
    """The controller's side of sharded snapshots: what to capture, how to restore, and the
    full copy a durable snapshot still needs (rank 0 writes the whole state to disk)."""

    def __init__(self, rank: int = 0, world: int = 1, fsdp: bool = False):
        # under FSDP each rank's state is already its shard: kept whole (world 1 here), and
        # durable snapshots go through torch.distributed.checkpoint (rollback/dcp.py)
        self.rank, self.world, self.fsdp = rank, (1 if fsdp else world), fsdp
        self.cuda: _CudaCopy | None = None
        self._durable: dict | None = None  # the full host copy rank 0 last handed the writer
        self._durable_copy: _CudaCopy | _ThreadCopy | None = None  # that copy, in flight
        # rollback.copy_async: a memory snapshot's host copy off the step; that copy, in flight
        self.host_async, self._ring_copy = True, None

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def capture(self, parts: dict[str, Any], old: dict, optimizer=None) -> dict[str, Any]:
        """The big parts of a snapshot (model and optimizer state dicts) as this rank keeps
        them: ``{SHARD: ShardedState}`` sharded, else full host copies by name. ``old``: the
        recycled state of a snapshot that left the ring."""
        if not self.sharded:  # what only the optimizer step writes: on a thread (copy_split)
            late = optimizer_written(optimizer) if self.host_async and optimizer else set()
            if late and self._ring_copy is None:
                self._ring_copy = _ThreadCopy()
            return copy_split(parts, old, late, self._ring_copy)
        lay = Layout(parts)
        on_cuda = any(t.is_cuda for t in lay.tensors)
        if on_cuda and self.cuda is None:
            self.cuda = _CudaCopy()
        if on_cuda and optimizer is not None:
            self.cuda.guard(optimizer)
        return {
            SHARD: ShardedState.capture(
                lay, self.rank, self.world, old.get(SHARD), self.cuda if on_cuda else None
            )
        }

    def whole(self, state: dict) -> dict:
        """``state`` with its sharded part gathered back (a collective when sharded)."""
        shard = state.get(SHARD)
        if shard is None:
            self.fence()  # a host copy in flight has landed before it is read
            return state
        if self.cuda is not None:
            self.cuda.fence()  # the restore's copies into the live tensors come after it
        self.fence()
        rest = {k: v for k, v in state.items() if k != SHARD}
        return {**rest, **shard.gather()}

    def write_durable(
        self, snap: Snapshot, parts: dict, writer, directory: Path, model, optimizer
    ) -> None:
        """Every rank calls this at a durable step. FSDP: every rank writes its shard (DCP,
        in line: a collective); else rank 0 hands the whole state to the background writer,
        which writes it once the copy of the live state (``durable``) has landed."""
        if self.fsdp:
            from stabilize.rollback.dcp import save_sharded

            writer.wait()
            save_sharded(snap, model, optimizer, directory, writer.keep)
        elif self.rank == 0:
            whole = self.durable(snap, parts, writer, optimizer)
            copy = self._durable_copy if self.sharded else self._ring_copy
            ready = copy.wait if copy is not None else None
            writer.submit(whole, directory, ready=ready)

    def durable(self, snap: Snapshot, parts: dict[str, Any], writer, optimizer=None) -> Snapshot:
        """The snapshot to write to disk: the whole state. Sharded, rank 0 copies the full
        parts into one host buffer of its own, reused from write to write (after waiting for
        the write that still reads it). The copy is not made on the training thread: on
        CUDA into pinned buffers on a side stream, on the host on a thread; the next write
        into those tensors (``fence``: the next optimizer step, a fault's parameter write,
        a restore) waits for it."""
        if not self.sharded:
            return snap
        if self._durable is not None and writer.busy_with(self._durable):
            writer.wait()
        if snap.state[SHARD].cuda is not None:
            snap.state[SHARD].ready()
        self.fence()  # the buffers about to be refilled are no longer being read
        old = self._durable or {}
        on_cuda = snap.state[SHARD].cuda is not None
        full, dst, src = {}, [], []
        for k, v in parts.items():
            full[k], d, s = to_cpu_deferred(v, old.get(k), pin=on_cuda)
            dst += d
            src += s
        if self._durable_copy is None:
            self._durable_copy = _CudaCopy() if on_cuda else _ThreadCopy()
        if dst:
            self._durable_copy.copy(dst, src)
            if optimizer is not None:
                self._durable_copy.guard(optimizer)
        rest = {k: v for k, v in snap.state.items() if k != SHARD}
        self._durable = {**rest, **full}
        return Snapshot(snap.step, self._durable, snap.wall)

    def fence(self) -> None:
        """Wait for the copies in flight (durable, memory): before anything writes the live
        state (the optimizer step and a fault's write, after the backward; a restore)."""
        if self._durable_copy is not None:
            self._durable_copy.fence()
        if self._ring_copy is not None:
            self._ring_copy.fence()


def host_bytes(obj: Any) -> int:
    """Host memory held by a snapshot state: every distinct tensor storage once."""
    seen: set[int] = set()
    total = 0

    def walk(o):
        nonlocal total
        if isinstance(o, ShardedState):
            for s in o.slices.values():
                walk(s)
        elif isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return total
