"""Where a non-finite gradient started: the failing step re-run with hooks, else read off
the step's own gradients.

On a step whose gradient norm is not finite (a NaN or inf, an fp16 scaler skip), the
callback first re-runs the step in-process with hooks on every module (``localize.locate``,
the same trace ``stabilize-replay`` uses on the step's bundle, so the two name the same
module): the first module whose gradient went non-finite, and whether its incoming gradient
was finite (finite: the module made the value). It costs one forward and backward, on the
first non-finite step of an episode only (the console prints that one; a ROLLBACK verdict's
replay localizes every time, ``classify.py``); healthy steps pay nothing.

A transient fault (a flipped bit, a bad host) does not recur in the re-run; then only the
step's own gradients can tell, and ``scan`` reads them once, before the optimizer step,
after the unscale:

- the modules that own parameters, in backward order (the reverse of the order they were
  built in: the head first, the embeddings last); the first with a non-finite gradient is
  named, with whether its incoming gradient was finite, *inferred*: for the first module in
  backward order it is the loss's finiteness; for any other, every module before it had
  finite gradients, so what reached it came through them finite;
- a tied weight (GPT-2's ``lm_head`` = ``wte``) holds the sum of its uses: the head's
  gradient and the embedding's, which comes up through every block (a norm's input gradient
  included). The scan cannot tell them apart, so its words name both owners and claim no
  origin: on the README's fp16 post-norm run the scan alone charged ``lm_head`` where the
  re-run and the replay name ``h.0.ln_1``.

Under DDP the gradients are already averaged over ranks, so the scan names the module, the
re-run the rank too. Under FSDP (sharded gradients) neither is made, like the replay: each
rank would see only its shard (and in tests here a scan there made a rank abort at exit, 2
runs in 14). Per-block gradient norms of the same pass are returned too, non-finite ones
kept (the log of that step shows them as inf / nan).
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


def owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every module that holds it as its own (a tied weight: several)."""
    out: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), []).append(name or "model")
    return out


def _grad(p: nn.Parameter) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    local = dtensor_local(g)
    return local if local is not None else g


def scan(model: nn.Module, loss_finite: bool = True, view=None) -> dict[str, Any]:
    """The first module in backward order whose gradient is not finite (None: every
    gradient is finite), whether its incoming gradient was (inferred, see above; None where
    the weight is tied and the scan cannot know), the other owners of a tied weight, how
    many modules had one, and each block's gradient norm."""
    if view is None:  # the probe's, when there is one (view.py)
        from stabilize.stability.view import view_of

        view = view_of(model)
    first, position, bad, shared = None, 0, 0, []
    held = owners(model)
    norms: dict[str, float] = {}
    for i, (name, params) in enumerate(backward_order(model)):
        grads = [(p, g) for p in params if (g := _grad(p)) is not None]
        if not grads:
            continue
        norm = float(torch.linalg.vector_norm(torch.stack([g.float().norm() for _, g in grads])))
        block = view.block_of(name)
        norms[block] = math.hypot(norms.get(block, 0.0), norm)  # inf and nan stay so
        if not math.isfinite(norm):
            bad += 1
            if first is None:
                first, position = name, i
                sick = [p for p, g in grads if not bool(torch.isfinite(g).all())]
                shared = sorted({o for p in sick for o in held[id(p)]} - {name})
    if first is None:
        return {"grad_module": None, "block_grad_norm": norms}
    incoming: bool | None = loss_finite if position == 0 else True
    if shared and loss_finite:
        incoming = None  # the sum of the uses: where it was made is not known
    out = {
        "grad_module": first,
        "grad_incoming_finite": incoming,
        "nonfinite_modules": bad,
        "block_grad_norm": norms,
        "loss_finite": loss_finite,
        "found_by": "scan",
    }
    if shared:
        out["shared_with"] = shared
    return out


def with_rerun(info: dict[str, Any], loc: dict[str, Any] | None) -> dict[str, Any]:
    """The scan's result where the step's re-run (``localize.locate``: one rank's
    localization, or None) named the module; what the scan alone said is kept as
    ``scan_module``. A re-run that stayed finite is said (``rerun``: "finite")."""
    if loc is None or not loc.get("grad_module"):
        return {**info, "rerun": "finite"}
    out = {k: v for k, v in info.items() if k != "shared_with"}
    out.update(
        grad_module=loc["grad_module"],
        grad_incoming_finite=loc.get("grad_incoming_finite"),
        found_by="rerun",
        scan_module=info.get("grad_module"),
    )
    for k in ("from_loss", "from_forward"):
        if loc.get(k):
            out[k] = loc[k]
    if loc.get("rank") is not None:
        out["rank"] = loc["rank"]
    return out


def describe(info: dict[str, Any]) -> str:
    """The console's words for the result (one wording, also the summary's and the
    diagnosis': ``origin``)."""
    if info.get("grad_module") is None:
        return "every gradient of the step is finite"
    return f"first non-finite gradient: {origin(info)}"


def origin(info: dict[str, Any]) -> str:
    """Where the non-finite gradient was made, saying how it is known and no more."""
    name = info["grad_module"]
    if info.get("found_by") == "rerun":
        how = "the step re-run with hooks"
        if info.get("from_loss"):
            fwd = info.get("from_forward")
            made = (f"the forward was (first non-finite output in {fwd}), so the loss was"
                    if fwd else "the loss was, its forward finite")  # fmt: skip
            return f"none made it: {made}, and every gradient from it on ({how})"
        made = (
            "it made the non-finite value"
            if info.get("grad_incoming_finite")
            else "it came in non-finite: made between modules"
        )
        return f"{name} ({made}; {how})"
    rerun = "; the re-run of the step was finite" if info.get("rerun") == "finite" else ""
    if not info.get("loss_finite", True):
        return (f"none made it: the loss was non-finite, so every gradient was (the first in "
                f"backward order, {name}, came in non-finite){rerun}")  # fmt: skip
    if info.get("shared_with"):
        others = " and ".join(info["shared_with"])
        return (f"the weight {name} shares with {others}, first in backward order (its "
                f"gradient sums every use: made at {name} or anywhere below it, down to "
                f"{info['shared_with'][-1]}){rerun}")  # fmt: skip
    made = (
        "its incoming gradient was finite: it made the non-finite value"
        if info.get("grad_incoming_finite")
        else "its incoming gradient was already non-finite"
    )
    return f"{name} (backward order, from the step's gradients; {made}){rerun}"
