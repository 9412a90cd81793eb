"""FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's ModelParallelStrategy,
on CPU (gloo) as on CUDA.

``trainer.strategy=fsdp`` builds a ``ModelParallelStrategy`` with every process on the
data-parallel axis of the device mesh (no tensor parallelism); the module's
``configure_model`` then shards each Block and the root (embeddings, tied head, final norm)
with ``fully_shard``: each rank holds 1/world of every parameter, gradient and AdamW moment,
as DTensors. Checkpoints are torch.distributed.checkpoint (DCP) directories: every rank
writes its shard, and DCP reshards on load, so a run saved by 2 ranks resumes on 1 or 2.
(Lightning's ``FSDPStrategy`` is FSDP1 and wants CUDA.)
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy on the data-parallel axis only, whose checkpoint directories
    appear whole or not at all: every rank writes its shard into ``<name>.tmp``, then rank 0
    renames it over ``<name>`` (a crash mid-write leaves the previous checkpoint intact;
    ``lit/checkpoint.verify_checkpoint`` knows a whole one by its metadata files)."""

    def __init__(self, world_size: int, timeout: timedelta = timedelta(seconds=1800)):
        super().__init__(
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            timeout=timeout,
        )

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()  # every shard and rank 0's meta.pt are written
        if self.is_global_zero:
            old = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        self.barrier()


def fsdp_strategy(world_size: int, timeout: timedelta) -> ModelParallelStrategy:
    return FSDP2Strategy(world_size, timeout)


def is_fsdp(strategy: Any) -> bool:
    return isinstance(strategy, ModelParallelStrategy)


def is_sharded(model: nn.Module) -> bool:
    """Has ``fully_shard`` been applied (its parameters are DTensor shards)?"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, mesh, mp_policy=None) -> None:
    """``fully_shard`` each Block, then the root: one all-gather per block in the forward,
    one reduce-scatter per block in the backward (the root's group holds the embeddings and
    the head tied to them). ``mp_policy``: FSDP2's mixed-precision policy (the gradient
    reduction's dtype, lit/grad_reduce.py), None for its default."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for block in model.h:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A total norm computed over DTensor gradients is a DTensor (partial per rank): the
    global value, as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm
