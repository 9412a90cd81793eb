"""The output logits: Gemma 2's soft cap, their log-partition log Z, and PaLM's z-loss.

- Soft cap (Gemma 2, Team Gemma 2024): logits -> cap * tanh(logits / cap), so no logit
  leaves (-cap, cap) however large the head's output grows; ~identity well inside it.
- log Z = logsumexp over the vocabulary of one token's logits: the softmax's normaliser.
  Cross-entropy only sees logits up to a shift, so nothing stops log Z drifting; large
  logits then lose precision in 16-bit formats.
- z-loss (PaLM, Chowdhery et al. 2022, sec. 5; used by Wortsman et al. 2023 against output
  logit divergence): coefficient * mean(log Z^2) added to the loss pulls log Z to 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LogitSoftcap(nn.Module):
    """``cap * tanh(x / cap)``; ``cap = 0`` passes the logits through (the module is always
    there, so the module tree has one shape; ``GPT.logit_softcap`` is this module)."""

    def __init__(self, cap: float = 0.0):
        super().__init__()
        self.cap = float(cap)
        # a probe reading each training loss's log Z (``record_log_z``; lm_loss's ``sink``)
        self.stats_sink = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cap <= 0:
            return x
        return self.cap * torch.tanh(x / self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}" if self.cap > 0 else "off"


CHUNK_ELEMS = 1 << 24  # fp32 elements converted at a time by log_z: 64 MB, whatever V


def log_z(logits: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> torch.Tensor:
    """[..., V] -> [...]: logsumexp over the vocabulary, in fp32 whatever the logits' dtype.

    16-bit logits are converted ``chunk_elems`` at a time (whole rows), not all at once: at
    gpt-1.3b x 16 x 2048 tokens a full fp32 copy is 6.6 GB per micro-batch, a chunk 64 MB.
    Each row's logsumexp is the same either way (rows are independent)."""
    if logits.dtype == torch.float32:  # .float() would be the tensor itself: no copy
        return torch.logsumexp(logits, dim=-1)
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    rows = max(1, chunk_elems // v)
    if flat.shape[0] <= rows:
        return torch.logsumexp(flat.float(), dim=-1).reshape(logits.shape[:-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, flat.shape[0], rows):
        out[i : i + rows] = torch.logsumexp(flat[i : i + rows].float(), dim=-1)
    return out.reshape(logits.shape[:-1])


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, sink=None, upcast=True
) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (logits [B, T, V], targets [B, T]), plus
    ``z_loss * mean(log Z^2)`` when the coefficient is positive. ``upcast=False``
    (``model.loss_dtype=logits``): in the logits' own dtype instead.

    ``sink``: given every token's log Z (``sink.record_log_z``, [B*T], no gradient), read
    off the loss's own log-softmax: log Z = x_y - log_softmax(x)_y at the target y, where
    log_softmax is small (-loss per token), so nothing is lost to cancellation. The same two
    ops F.cross_entropy runs (log_softmax, then nll_loss): the same loss, and no second pass
    over the [B*T, V] logits for the monitor."""
    flat = logits.flatten(0, 1)  # [B*T, V]
    flat = flat.float() if upcast else flat
    tgt = targets.flatten()
    if sink is None:
        loss = F.cross_entropy(flat, tgt)
    else:
        lsm = F.log_softmax(flat, dim=-1)
        loss = F.nll_loss(lsm, tgt)
        with torch.no_grad():
            at = tgt.unsqueeze(1)
            sink.record_log_z((flat.gather(1, at) - lsm.gather(1, at)).squeeze(1))
    if z_loss > 0:
        loss = loss + z_loss * log_z(flat).square().mean()
    return loss
