"""The curvature along the optimizer's update, from one difference of gradients
(docs/design-spikes.md sections 1-2).

For the update u AdamW is about to apply (``param_stats.adamw_terms``), one Hessian-vector
product by a central difference of gradients,

    H u ~ (g(theta + h u) - g(theta - h u)) / 2h,   ||h u|| = REL ||theta||,

each gradient one more forward and backward of the step's micro-batches in fp32 from the
moved weights (``step_gradient``), the weights then restored bit for bit from a copy. Then
two quotients:

- ``curv_u = u^T H u / ||u||^2``: the curvature along the update, against gradient
  descent's stability line 2 / lr;
- ``curv_pre = u^T H u / u^T P u``, P = (1 - beta1^t) (diag(sqrt(v_hat)) + eps): the
  update's preconditioned curvature, a lower bound of Adam's preconditioned sharpness
  lambda_max(P^-1 H), against its line (2 + 2 beta1) / ((1 - beta1) lr) (38 / lr at
  beta1 = 0.9; Cohen et al. 2207.14484).

A double backward would give H u exactly but PyTorch's CPU flash attention has none, and
the math kernel would change the step's numerics; a forward difference from the step's own
gradient (one pass fewer) is biased by the third derivative along u (on the tiny GPT along
AdamW's sign-like direction: 12% at the step where the central difference is 0.003%; the
table of scripts/hvp_check.py), and under autocast the gradient's own 16-bit rounding is
larger than the difference (docs/design-spikes.md section 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

REL = 1e-4  # ||h u|| / ||theta|| (docs/design-spikes.md: measured against a double backward)


def dot64(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum over tensors of <a, b>, in float64 (a log step's few sums: exact enough)."""
    return sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True))


def hvp_difference(
    params: Sequence[torch.Tensor],
    u: Sequence[torch.Tensor],
    grad_at: Callable[[], Sequence[torch.Tensor]],
    rel: float = REL,
) -> tuple[list[torch.Tensor], float]:
    """(H u, h): the central difference of gradients along ``u`` at ``params``,
    ``(g(theta + h u) - g(theta - h u)) / 2h``; ``grad_at()`` computes the gradient at the
    weights as they are when it is called. The weights are restored exactly, whatever
    ``grad_at`` raises."""
    with torch.no_grad():
        w = math.sqrt(float(dot64(params, params)))
        n = math.sqrt(float(dot64(u, u)))
    if not (n > 0 and math.isfinite(n) and math.isfinite(w)):
        raise ValueError("the update direction is zero or not finite: no curvature along it")
    h = rel * max(w, 1e-12) / n
    saved = [p.detach().clone() for p in params]
    grads = []
    try:
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, s0, d in zip(params, saved, u, strict=True):
                    p.copy_(s0).add_(d.to(p.dtype), alpha=sign * h)
            grads.append(grad_at())
    finally:
        with torch.no_grad():
            for p, s0 in zip(params, saved, strict=True):
                p.copy_(s0)
    plus, minus = grads
    hu = [(a.double() - b.double()) / (2 * h) for a, b in zip(plus, minus, strict=True)]
    return hu, h


def quotients(
    u: Sequence[torch.Tensor], hu: Sequence[torch.Tensor], pdiag: Sequence[torch.Tensor]
) -> tuple[float, float]:
    """(u^T H u / ||u||^2, u^T H u / u^T P u), P diagonal given as ``pdiag``."""
    uhu, uu = float(dot64(u, hu)), float(dot64(u, u))
    upu = float(sum((x.double() ** 2 * p.double()).sum() for x, p in zip(u, pdiag, strict=True)))
    return (uhu / uu if uu else math.nan), (uhu / upu if upu else math.nan)


def stability_lines(lr: float, beta1: float) -> tuple[float, float]:
    """(2 / lr, (2 + 2 beta1) / ((1 - beta1) lr)): gradient descent's and Adam's lines."""
    return 2.0 / lr, (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)


def step_gradient(loop, host, batches, positions, params) -> list[torch.Tensor]:
    """The gradient of the step's micro-batches with respect to ``params`` at the weights as
    they are now, in fp32 (no autocast: a difference of two gradients needs more than 16
    bits), dropout seeded by data position as the step's own, the mean over ranks; clean: no
    fault armed and no statistics (the caller turns the probe off). ``torch.autograd.grad``:
    no ``.grad`` of any parameter is touched (the watched model's or another's). The RNG
    state is kept."""
    rng = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    # fp32 matmuls in fp32: a run that allows TF32 (set_float32_matmul_precision "high", as
    # Lightning suggests on an A100) keeps 10 bits of each operand's mantissa, a rounding of
    # up to 2^-11 ~ 5e-4 of it, where the difference moves the weights by 1e-4 of themselves
    matmul = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for batch, pos in zip(batches, positions, strict=True):
            host.seed_dropout(pos)
            loss = host.loss(batch).float() / len(batches)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for t, g in zip(total, grads, strict=True):
                if g is not None:
                    t.add_(g.float())
        if loop.world > 1:  # the mean over ranks, as DDP's reduce
            flat = torch.cat([g.reshape(-1) for g in total]) / loop.world
            torch.distributed.all_reduce(flat)
            total = [f.reshape(p.shape) for f, p in
                     zip(flat.split([g.numel() for g in total]), params, strict=True)]  # fmt: skip
        return total
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def curvature_pass(loop, host, optimizer, batches, positions, rel: float = REL):
    """The probe's ``curvature`` for this step: (curv_u, curv_pre), or None where it is not
    measured (16-bit weights: a move of ``rel`` rounds away; a fault that fires at this
    step on any rank: its gradient is in the step's but not in the clean one)."""

    def curvature(params, updates, pdiags):
        if any(p.dtype != torch.float32 for p in params):
            return None
        # no step (lr 0 at the warmup's start) or a non-finite one (a NaN or inf gradient,
        # an fp16 scaler skip): no direction. Every rank sees the same all-reduced
        # gradients, so every rank decides alike.
        n2 = float(dot64(updates, updates))
        if not (n2 > 0 and math.isfinite(n2)):
            return None
        inj = host.injector  # fired at this step (read, not asked: fires() marks a firing)
        fires = inj is not None and host.train_state.model_step + 1 in inj.fired
        if loop.world > 1:  # every rank takes the same decision
            flag = torch.tensor([float(fires)], device=host.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            fires = bool(flag.item())
        if fires:
            return None
        hu, _ = hvp_difference(
            params, updates, lambda: step_gradient(loop, host, batches, positions, params), rel
        )
        q = quotients(updates, hu, pdiags)
        return q if all(math.isfinite(v) for v in q) else None

    return curvature


def double_backward_hvp(loss_fn, params, u) -> list[torch.Tensor]:
    """H u exactly, by double backward (the checks' reference; not used in a run): the
    attention on PyTorch's math kernel, which has a double backward (the CPU flash kernel
    has none)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        g = torch.autograd.grad(loss_fn(), params, create_graph=True)
        dot = sum((a * b).sum() for a, b in zip(g, u, strict=True))
        return list(torch.autograd.grad(dot, params))
