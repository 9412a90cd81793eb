"""``trainer.grad_reduce_dtype``: the dtype the gradients are all-reduced in across ranks, a
precision site of a multi-rank run (issue 37; docs/precision.md).

DDP all-reduces each bucket of gradients in their own dtype (fp32 under mixed precision).
A recipe that communicates in bf16 halves the traffic and rounds every gradient to bf16
twice (its share before the sum, and the sum); one that upcasts bf16-true gradients to fp32
sums them without that rounding. ``reduce_in(dtype)`` is a DDP communication hook that
does either on any backend (PyTorch's own bf16 hook wants NCCL): each bucket divided by
the world size, cast to ``dtype``, summed, and cast back into the bucket. Under FSDP2 the
same choice is ``MixedPrecisionPolicy(reduce_dtype=...)`` (``fsdp_policy``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def reduce_in(dtype: torch.dtype):
    """A DDP communication hook: the bucket's mean over the ranks, summed in ``dtype``."""

    def hook(state, bucket):
        buf = bucket.buffer()
        group = state if state is not None else dist.group.WORLD
        share = buf.float().div(dist.get_world_size(group)).to(dtype)  # divided in fp32
        fut = dist.all_reduce(share, group=group, async_op=True).get_future()

        def back(f):
            return buf.copy_(f.value()[0])

        return fut.then(back)

    return hook


def ddp_hook(name: str):
    """The hook for ``trainer.grad_reduce_dtype`` (None for ``grad``: DDP's own)."""
    return reduce_in(DTYPES[name]) if name in DTYPES else None


def fsdp_policy(name: str):
    """FSDP2's ``mp_policy`` for it (None for ``grad``: FSDP's default)."""
    if name not in DTYPES:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(reduce_dtype=DTYPES[name])
