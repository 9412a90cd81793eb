"""Where a non-finite gradient started, read off the failing step's own gradients.

A replay (localize.py) names the module only when the fault happens again; a transient one
(a flipped bit, a bad host) does not, and in fp16 the step is one scaler skip with no name.
The step's own gradients still hold the inf or NaN when the verdict is reached (before the
optimizer step, after the unscale), so on that event only (healthy steps pay nothing) they
are scanned once:

- the modules that own parameters, in backward order (the reverse of the order they were
  built in: the head first, the embeddings last; a tied weight belongs to the owner that
  comes first in that order, the output head);
- the first of them with a non-finite gradient is named, with whether its incoming gradient
  (with respect to its output) was finite. That is *inferred*: for the first module in
  backward order it is the loss's own finiteness; for any other, every module before it in
  backward order had finite gradients, so what reached it came through them finite. Finite
  there means the module made the inf or NaN itself. A non-finite value made where no
  parameter is (a norm's input gradient, a softmax) is named at the next module in backward
  order; the replay, where the fault recurs, names it exactly.

Under DDP the gradients are already averaged over ranks, so the module is named, not the
rank. Under FSDP (sharded gradients) the scan is not made, like the replay: each rank would
see only its shard (and in tests here a scan there made a rank abort at exit, 2 runs in
14). Per-block gradient norms of the same pass are returned too, non-finite ones kept (the
log of that step shows them as inf / nan).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stabilize.compat import dtensor_local


def backward_order(model: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """(module name, its own parameters), in backward order; each parameter once."""
    mods = [(n or "model", m) for n, m in model.named_modules(remove_duplicate=False)]
    out, seen = [], set()
    for name, m in reversed(mods):
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for p in own}
        if own:
            out.append((name, own))
    return out


def _grad(p: nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    local = dtensor_local(g)
    return local if local is not None else g


def scan(model: nn.Module, loss_finite: bool = True) -> dict[str, Any]:
    """The first module in backward order whose gradient is not finite (None: every
    gradient is finite), whether its incoming gradient was (inferred, see above), how many
    modules had one, and each block's gradient norm."""
    first, position, bad = None, 0, 0
    norms: dict[str, float] = {}
    for i, (name, params) in enumerate(backward_order(model)):
        grads = [g for g in (_grad(p) for p in params) if g is not None]
        if not grads:
            continue
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        block = ".".join(name.split(".")[:2]) if name.startswith("h.") else "other"
        norms[block] = math.hypot(norms.get(block, 0.0), norm)  # inf and nan stay so
        if not math.isfinite(norm):
            bad += 1
            if first is None:
                first, position = name, i
    if first is None:
        return {"grad_module": None, "block_grad_norm": norms}
    return {
        "grad_module": first,
        "grad_incoming_finite": loss_finite if position == 0 else True,
        "nonfinite_modules": bad,
        "block_grad_norm": norms,
    }


def describe(info: dict[str, Any]) -> str:
    """The console's words for a scan's result."""
    name = info.get("grad_module")
    if name is None:
        return "every gradient of the step is finite"
    made = (
        "its incoming gradient was finite: it made the non-finite value"
        if info.get("grad_incoming_finite")
        else "its incoming gradient was already non-finite"
    )
    return f"first non-finite gradient in backward order: {name} ({made})"
