"""Statistics the probe takes on logged steps only: the lowest
attention-head entropy, and per block the gradient norm and the update/weight ratio.

Both stay on the device (the step's one gather moves them to the host with everything else).

- Head entropy (Zhai et al. 2023: attention entropy collapse accompanies divergence): for one
  sequence of the batch and up to ``ROWS`` strided query rows, the causal attention
  probabilities of every head, softmax(q k^T / sqrt(d)); each head's entropy is the mean over
  those rows of -sum p log p (nats), and the block's value is the lowest over heads. A head
  attending to one key has 0; uniform attention over t keys has log t.
- Update/weight ratio: ||delta W|| / ||W|| per block for the step about to be applied,
  computed before it as torch's AdamW will do it (decoupled decay, bias-corrected moments,
  the gradients scaled by the clipping coefficient the step will use), so no copy of the
  weights is kept. Another optimizer (or amsgrad / maximize): not measured.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stabilize.cpu_kernels import adamw_sums

ROWS = 64  # query rows sampled per sequence for the entropy


def param_groups_by_block(model: nn.Module, view) -> tuple[dict[str, list], list[int]]:
    """{group: [parameters]} per block of ``view`` (a ``ModelView``: ``h.{i}`` on our GPT)
    and ``other`` (embeddings, final norm; the tied head once), and each listed parameter's
    group index, in the order the groups list them."""
    groups: dict[str, list] = {name: [] for name, _ in view.blocks}
    groups["other"] = []
    for name, p in model.named_parameters():  # deduplicated: the tied weight appears once
        groups[view.block_of(name)].append(p)
    index = [i for i, ps in enumerate(groups.values()) for _ in ps]
    return groups, index


def sampled_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, d] -> (the first sequence's queries at strided rows [H, R, d] in fp32,
    their positions [R])."""
    t = q.shape[2]
    rows = torch.arange(t - 1, -1, -max(1, t // ROWS), device=q.device)  # the last row first
    return q[0, :, rows].float(), rows


def lowest_head_entropy(qs: torch.Tensor, rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The lowest over heads of the mean causal attention entropy (nats) at ``rows``.
    qs [H, R, d], rows [R], k [B, H, T, d] (the first sequence's keys are used)."""
    k0 = k[0].float()  # [H, T, d]
    scores = qs @ k0.transpose(-1, -2) / math.sqrt(k0.shape[-1])  # [H, R, T]
    future = torch.arange(k0.shape[1], device=k.device)[None, :] > rows[:, None]  # [R, T]
    p = scores.masked_fill(future, -math.inf).softmax(-1)
    return torch.special.entr(p).sum(-1).mean(-1).amin()  # entr(0) = 0: masked keys add 0


def adamw_terms(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict):
    """What torch's AdamW is about to do to ``p`` for gradient ``g``, in fp32: (the change
    it makes, up to its sign; its preconditioner P = (1 - beta1^t) (sqrt(v_hat) + eps), so
    that the change is lr P^-1 m + lr wd p; g^2 / v_hat with this step's v_hat, 0 where
    v_hat is 0). g^2 / v_hat is 1 where the gradient is as large as its recent history and
    at most (1 - beta2^t) / (1 - beta2) where it surprises a decayed v_hat."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    b1, b2 = group["betas"]
    step = float(state["step"]) + 1 if state else 1.0  # a CPU tensor (not capturable)
    p, g = p.float(), g.float()  # in fp32 whatever the parameters' dtype (bf16-true)
    m = torch.lerp(state["exp_avg"].float(), g, 1 - b1) if state else g * (1 - b1)
    v = state["exp_avg_sq"].float() * b2 + g * g * (1 - b2) if state else g * g * (1 - b2)
    vhat = v / (1 - b2**step)
    denom = vhat.sqrt() + eps
    change = p * (lr * wd) + m / denom * (lr / (1 - b1**step))
    ratio = torch.where(vhat > 0, g * g / vhat, torch.zeros_like(g))
    return change, denom * (1 - b1**step), ratio


def _plain_adamw(optimizer) -> bool:
    return type(optimizer).__name__ == "AdamW" and not any(
        gr.get("amsgrad") or gr.get("maximize") for gr in optimizer.param_groups
    )


def block_grad_update_norms(
    groups: dict[str, list],
    idx: torch.Tensor,
    optimizer,
    grad_norm: torch.Tensor,
    max_norm: float,
    keep: bool = False,
):
    """Per group: the gradient norm (pre-clip), ||update|| / ||W|| and the mean of
    g^2 / v_hat over its elements ([G] each, fp32, on the device; the last two -1 where the
    optimizer is not plain AdamW), then the whole model's update ratio and mean g^2 / v_hat
    (two scalars, -1 likewise), then with ``keep`` each parameter's (update, P) for the
    curvature (``adamw_terms``; else None). ``idx``: each parameter's group
    (``param_groups_by_block``), on the device; ``grad_norm``: the step's total pre-clip
    norm; ``max_norm``: the clipping threshold (0: none). None for sharded (DTensor)
    gradients, whose per-block norms would need a collective."""
    params = [p for ps in groups.values() for p in ps]
    grads = [p.grad for p in params]
    if not params or any(g is not None and hasattr(g, "to_local") for g in grads):
        return None
    dev, ng = idx.device, len(groups)
    zero = torch.zeros((), device=dev)
    gsq = torch.stack([g.float().square().sum() if g is not None else zero for g in grads])
    grad = torch.zeros(ng, device=dev).index_add_(0, idx, gsq).sqrt()
    if not _plain_adamw(optimizer):
        none = torch.full((ng,), -1.0, device=dev)
        return grad, none, none, torch.full((2,), -1.0, device=dev), None
    coef = (max_norm / (grad_norm.float() + 1e-6)).clamp(max=1.0) if max_norm > 0 else None
    owner = {id(p): gr for gr in optimizer.param_groups for p in gr["params"]}
    # the three sums from one C++ pass per parameter where it runs (CPU, fp32): ~20 torch
    # passes and their temporaries were most of a log step's monitoring on CPU
    fast = not keep and dev.type == "cpu"
    cf = (1.0 if coef is None else float(coef)) if fast else 1.0
    usq, wsq, rsum, count, kept = [], [], [], [], []
    for p, g in zip(params, grads, strict=True):
        w = p.detach()
        if g is not None and id(p) in owner and fast:
            sums = adamw_sums(w, g, optimizer.state.get(p, {}), owner[id(p)], cf)
            if sums is not None:
                usq.append(sums[0])
                wsq.append(sums[1])
                rsum.append(sums[2])
                count.append(torch.full((), float(g.numel()), device=dev))
                kept.append(None)
                continue
        w = w.float()
        wsq.append(w.square().sum())
        if g is None or id(p) not in owner:
            usq.append(zero)
            rsum.append(zero)
            count.append(zero)
            kept.append(None)
            continue
        g = g.float() if coef is None else g.float() * coef  # as clipping will scale it
        change, pdiag, ratio = adamw_terms(w, g, optimizer.state.get(p, {}), owner[id(p)])
        usq.append(change.square().sum())
        rsum.append(ratio.sum())
        count.append(torch.full((), float(ratio.numel()), device=dev))
        kept.append((change, pdiag) if keep else None)
    stack = torch.stack
    upd = torch.zeros(ng, device=dev).index_add_(0, idx, stack(usq))
    wgt = torch.zeros(ng, device=dev).index_add_(0, idx, stack(wsq))
    rs = torch.zeros(ng, device=dev).index_add_(0, idx, stack(rsum))
    cn = torch.zeros(ng, device=dev).index_add_(0, idx, stack(count))
    whole = stack([upd.sum().sqrt() / wgt.sum().sqrt(), rs.sum() / cn.sum().clamp(min=1)])
    g2v = torch.where(cn > 0, rs / cn.clamp(min=1), torch.full_like(rs, -1.0))
    return grad, upd.sqrt() / wgt.sqrt(), g2v, whole, kept if keep else None
