"""Activation checkpointing: each Block's forward recomputed in the backward.

Why: the seed's recipe (configs/experiment/nan_at_12000.yaml) runs a micro-batch of
16 x 2048 tokens per GPU through gpt-1.3b; its activations alone outgrow an 80 GB A100
(docs/memory.md). Keeping only each Block's input and recomputing the rest in the backward
trades about one extra forward for that memory (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost").

``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the non-reentrant variant
works with hooks, keyword arguments and inputs that do not require grad, and restores the
RNG state (dropout masks) and the autocast state for the recompute, so the recomputed
forward is the original one bit for bit.

The recompute runs every module inside the Block a second time, the norms included, and a
norm reports its statistics to a probe (``Norm.stats_sink``) from its training forward:
the probe's counts (overflowed rows, collapsed rows) would double. During the recompute
the Block's norms therefore report to no one (``context_fn``'s second context; the
first, the original forward's, is a no-op), and ``recomputing()`` is true, so forward
hooks on modules inside a Block (the probe's attention-bound q/k hooks: ~32 GB of extra
reads per micro-batch at gpt-1.3b, read from the code) skip the second pass. Forward hooks
on the Block itself (the probe's block maximum, the drift fault) run once: they are outside
the checkpointed function.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stabilize.norms import Norm

_recomputing = [0]  # recomputes in flight (the backward may run them on its own thread)


def recomputing() -> bool:
    """Is a checkpointed Block being recomputed (in the backward) right now?"""
    return _recomputing[0] > 0


@contextmanager
def norms_silent(module: nn.Module):
    """The norms inside ``module`` report no statistics while this lasts (the recompute),
    and ``recomputing()`` says so to hooks inside it."""
    norms = [m for m in module.modules() if isinstance(m, Norm)]
    sinks = [m.stats_sink for m in norms]
    for m in norms:
        m.stats_sink = None
    _recomputing[0] += 1
    try:
        yield
    finally:
        _recomputing[0] -= 1
        for m, sink in zip(norms, sinks, strict=True):
            m.stats_sink = sink


def recomputed(module: nn.Module, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` (the module's own forward), its activations recomputed in the backward."""
    return checkpoint(
        fn, x, use_reentrant=False, context_fn=lambda: (nullcontext(), norms_silent(module))
    )


def set_activation_checkpointing(model: nn.Module, on: bool = True) -> int:
    """Turn checkpointing of every Block's forward on (or off) in ``model``; returns how
    many Blocks were set. Only training forwards with grad enabled are checkpointed."""
    n = 0
    for m in model.modules():
        if hasattr(m, "activation_checkpointing"):
            m.activation_checkpointing = on
            n += 1
    return n
