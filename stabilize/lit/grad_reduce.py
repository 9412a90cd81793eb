"""``trainer.grad_reduce_dtype``: the dtype the gradients are all-reduced in across ranks, a
precision site of a multi-rank run (docs/precision.md).

DDP all-reduces each bucket of gradients in their own dtype (fp32 under mixed precision).
A recipe that communicates in bf16 halves the traffic and rounds every gradient to bf16:
each rank's share before the sum, and the sum's partial results as the backend adds them
(once with 2 ranks; at every step of a ring or a tree with more); one that upcasts bf16-true
gradients to fp32 sums them without that rounding. ``reduce_in(dtype)`` is a DDP
communication hook that does either on any backend (PyTorch's own bf16 hook wants NCCL):
each bucket divided by the world size, cast to ``dtype``, summed, and cast back into the
bucket; ``ddp_strategy`` registers it on CPU too (Lightning's DDPStrategy only on CUDA).
Under FSDP2 the same choice is ``MixedPrecisionPolicy(reduce_dtype=...)`` (``fsdp_policy``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

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


class ReduceDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy with its communication hook registered on every device:
    Lightning's own registers a ``ddp_comm_hook`` on CUDA only, and would drop this one on
    CPU (gloo) without a word."""

    def _register_ddp_hooks(self) -> None:
        super()._register_ddp_hooks()
        if self._ddp_comm_hook is not None and self.root_device.type != "cuda":
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def ddp_strategy(name: str, **kwargs) -> DDPStrategy:
    """The DDP strategy for ``trainer.grad_reduce_dtype`` (Lightning's own for ``grad``)."""
    hook = ddp_hook(name)
    return ReduceDDPStrategy(ddp_comm_hook=hook, **kwargs) if hook else DDPStrategy(**kwargs)


def ddp_hook(name: str):
    """The hook for ``trainer.grad_reduce_dtype`` (None for ``grad``: DDP's own)."""
    return reduce_in(DTYPES[name]) if name in DTYPES else None


def fsdp_policy(name: str):
    """FSDP2's ``mp_policy`` for it (None for ``grad``: FSDP's default)."""
    if name not in DTYPES:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(reduce_dtype=DTYPES[name])
