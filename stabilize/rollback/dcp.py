"""Durable snapshots of a sharded (FSDP2) model through torch.distributed.checkpoint.

Under FSDP every rank holds a different shard, so no single rank can write the whole state
(before this, only rank 0 wrote the durable snapshot, and it held only rank 0's shard).
Here ``snapshot-NNNNNN/`` is a DCP directory: every rank writes its shard of the model and
AdamW state (keyed by parameter name, ``get_state_dict``), and rank 0 adds ``rest.pt``
(scheduler, scaler, counters, monitors, fault: small, the same on every rank). DCP stores
each tensor's global shape, so ``load_sharded`` fills a model at any world size: saved by 2
ranks, loaded by 1 (an unsharded model) or by 2. The directory is written under a
temporary name and renamed when complete: a crash mid-write leaves no half snapshot.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from stabilize.io import atomic_torch_save, verified_load
from stabilize.rollback.snapshots import Snapshot
from stabilize.trust import check_dcp_index

REST = "rest.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_sharded(
    snap: Snapshot, model: torch.nn.Module, optimizer, directory: str | Path, keep: int = -1
) -> Path:
    """Every rank calls this together (DCP's save is a collective). ``snap.state``: the
    small parts (its ``model`` / ``optimizer`` entries, if any, are not written: the live
    model and optimizer are, at the snapshot's step)."""
    final = Path(directory) / f"snapshot-{snap.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()
    state = {"model": get_model_state_dict(model)}  # DTensors: each rank's shard
    # Not before the first step: get_optimizer_state_dict initializes an empty optimizer's
    # state by stepping it with lr 0, so AdamW's first real step would count as its second
    # (a different bias correction)
    has_opt = bool(optimizer.state)
    if has_opt:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:  # DCP's save returns on rank 0 after every rank's shard is written
        rest = {k: v for k, v in snap.state.items() if k not in ("model", "optimizer", "shard")}
        rec = {"step": snap.step, "state": rest, "wall": snap.wall, "optimizer": has_opt}
        atomic_torch_save(rec, tmp / REST)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if keep > 0:
            prune_sharded(directory, keep)
    if dist.is_initialized():
        dist.barrier()
    return final


def prune_sharded(directory: str | Path, keep: int) -> list[Path]:
    """All but the newest ``keep`` snapshot directories (by step) deleted; the paths."""
    dirs = sorted(p for p in Path(directory).glob("snapshot-??????") if p.is_dir())
    old = dirs[: max(0, len(dirs) - keep)]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    return old


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer) -> Snapshot:
    """Load a DCP snapshot into ``model`` and ``optimizer`` (sharded or not, any world
    size: DCP reshards); the snapshot's small parts, as a ``Snapshot`` without the model
    and optimizer entries."""
    path = Path(path)
    check_dcp_index(path)  # before DCP unpickles it with no allow-list
    d = verified_load(path / REST)
    state = {"model": get_model_state_dict(model)}
    if d["optimizer"]:  # a snapshot before the first step has no optimizer state
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if d["optimizer"]:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return Snapshot(d["step"], d["state"], d["wall"])
