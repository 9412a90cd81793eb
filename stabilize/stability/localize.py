"""Replaying a step, and localizing a non-finite value in its forward and its backward.

Runs only on a fault, so healthy steps pay nothing. ``replay`` runs the step's
micro-batches again from the live weights (the step was made a no-op, so these are the
weights that failed), forward and backward, the fault's hooks included, and puts the live
gradients back afterwards. With ``trace`` it also localizes:

- forward: a hook on every module; the first module in execution order whose output is
  non-finite, and whether its input already was;
- backward: a full backward hook on every module and a post-accumulate hook on every
  parameter; the first module, in backward order, whose gradient went non-finite (the
  gradient it passes to its inputs, or one of its own parameters' gradients), and whether
  its incoming gradient (w.r.t. its output) was finite: a finite incoming gradient means
  the module made the NaN/inf. A tied weight's gradient is seen once, when both uses have
  accumulated (the embedding's, last), so the head is never charged with a value that
  came up through a norm's input gradient.

Pass-through modules (their output is their input: ``nn.Identity`` for an absent norm,
dropout at p = 0, the logit softcap when off) are never named: a NaN they carry was made
elsewhere. A backward whose first named module already received a non-finite gradient
is marked ``from_loss`` when that module is the first in backward order (the loss's own
gradient was non-finite: no module made it) and ``from_forward`` (the forward's module,
the origin) when the forward was non-finite too. The fault's hooks must be attached before the
trace's, so that the trace sees what the next module receives.

The replay's gradients are this rank's own until ``replay`` all-reduces them (a mean over
ranks, as DDP does), so that its grad norm speaks of the same thing as the step's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def _finite(t) -> bool:
    ts = [t] if isinstance(t, torch.Tensor) else [x for x in t if isinstance(x, torch.Tensor)]
    return all(bool(torch.isfinite(x).all()) for x in ts if x.is_floating_point())


class _Trace:
    """Forward and backward hooks on every module and parameter of ``model`` (removed by
    ``close``). The backward's events are taken in the order they happen: a module's full
    backward hook (its incoming gradient and the one it passes on), a parameter's
    post-accumulate hook (its gradient as the optimizer would see it: after the fault's
    tensor hooks). A parameter's event speaks for the module that owns it."""

    def __init__(self, model: torch.nn.Module):
        self.names = {m: n or "model" for n, m in model.named_modules()}
        self.passthrough: set[torch.nn.Module] = set()  # output is input: never named
        self.forward: dict[str, Any] = {}
        self.backward: dict[str, Any] = {}
        self.incoming: dict[str, bool] = {}  # module -> its incoming gradient was finite
        self.first: str | None = None  # the first module the backward reached (the head's)
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_hook(self._fwd))
            self.handles.append(m.register_full_backward_hook(self._bwd))
        for name, p in model.named_parameters():  # a tied weight once, by its first owner
            owner = name.rpartition(".")[0] or "model"
            self.handles.append(p.register_post_accumulate_grad_hook(self._acc(owner)))

    def _fwd(self, module, args, out):
        if isinstance(out, torch.Tensor) and any(out is a for a in args):
            self.passthrough.add(module)
            return
        if not self.forward and not _finite(out):
            self.forward.update(module=self.names[module], input_finite=_finite(args))

    def _bwd(self, module, grad_input, grad_output):
        if module in self.passthrough:
            return
        name = self.names[module]
        if self.first is None and any(isinstance(g, torch.Tensor) for g in grad_input):
            self.first = name  # (the root's hook, with no input gradient, fires before it)
        self.incoming.setdefault(name, _finite(grad_output))
        if not self.backward and not _finite(grad_input):
            self.backward["grad_module"] = name

    def _acc(self, owner: str):
        def hook(p):
            if not self.backward and not _finite(p.grad):
                self.backward["grad_module"] = owner

        return hook

    def result(self) -> dict[str, Any]:
        if not self.backward:
            return {"grad_module": None}
        # the owner's backward hook may come after its parameter's accumulation
        name = self.backward["grad_module"]
        out = {"grad_module": name, "grad_incoming_finite": self.incoming.get(name)}
        if out["grad_incoming_finite"] is False and name == self.first:
            out["from_loss"] = True  # the loss's own gradient was non-finite
            if self.forward:
                out["from_forward"] = self.forward["module"]
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def replay(loop, host, batches, positions, *, trace: bool = False) -> dict[str, Any]:
    """Forward and backward of ``batches`` (the step's micro-batches, at data positions
    ``positions``) from the live weights, the fault included (a transient one does not fire
    again). Returns the step's head for the gather (mean loss, grad norm after the
    all-reduce, the loss scale, found-inf), each micro-batch's loss, and with ``trace``
    this rank's localization."""
    model, inj = host.model, host.injector
    params = list(host.parameters())
    saved = [p.grad for p in params]
    scaler = loop.scaler()
    scale_t = getattr(scaler, "_scale", None) if scaler is not None else None
    scale = float(scale_t) if scale_t is not None else 1.0
    step, n = host.train_state.model_step + 1, len(batches)
    tr = _Trace(model) if trace else None
    losses = []
    try:
        for p in params:
            p.grad = None
        for batch, pos in zip(batches, positions, strict=True):
            host.seed_dropout(pos)
            if inj is not None:
                inj.begin(step, pos)
            with loop.forward_context(), warnings.catch_warnings():
                # a module returning a dataclass (Hugging Face's ModelOutput) gets no backward
                # hook: its children's name the gradient
                warnings.filterwarnings("ignore", "For backward hooks to be called")
                loss = host.loss(batch)
            if inj is not None:
                loss = inj.on_loss(step, loss)
                inj.arm(step, model)
            try:
                with warnings.catch_warnings():  # modules whose inputs need no gradient
                    warnings.filterwarnings("ignore", "Full backward hook is firing")
                    (loss * (scale / n)).backward()
            finally:
                if inj is not None:
                    inj.disarm()  # no after_backward: a replay flips no bit
            losses.append(loss.detach().float())
        grads = [p.grad for p in params if p.grad is not None]
        if loop.world > 1:  # the mean over ranks, as DDP's reduce
            flat = torch.cat([g.reshape(-1) for g in grads]) / loop.world
            torch.distributed.all_reduce(flat)
            grads = list(flat.split([g.numel() for g in grads]))
        gnorm = torch.nn.utils.get_total_norm(grads, foreach=True) / scale
    finally:
        if tr is not None:
            tr.close()
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    dev = host.device
    finite = torch.isfinite(gnorm)
    head = [
        torch.stack(losses).mean(),
        gnorm.float(),
        torch.full((), scale if scale_t is not None else -1.0, device=dev),
        (~finite).float() if scale_t is not None else torch.full((), -1.0, device=dev),
    ]
    out: dict[str, Any] = {"head": head, "losses": [float(v) for v in losses]}
    if tr is not None:
        out["localization"] = {
            **(tr.forward or {"module": None, "note": "the forward was finite"}),
            **tr.result(),
            "rank": loop.rank,
        }
    return out


def gather_reports(loop, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's report, on every rank (a list of one without DDP)."""
    if loop.world == 1:
        return [mine]
    every: list[Any] = [None] * loop.world
    torch.distributed.all_gather_object(every, mine)
    return every


def first_named(locs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of every rank's localization, the first that names a module in the backward (the
    rank that made the value; the others' local gradients were finite), else None."""
    return next((loc for loc in locs if loc.get("grad_module")), None)


def locate(loop, host, batches, positions) -> dict[str, Any] | None:
    """The failing step re-run with hooks (its micro-batches, from the live weights: one
    forward and backward), every rank's localization gathered: ``first_named`` of them.
    Every rank must call it (the re-run all-reduces its gradients, as DDP does)."""
    r = replay(loop, host, batches, positions, trace=True)
    return first_named(gather_reports(loop, r["localization"]))
