"""Attention, MLP and the Block, whose norm placement is the main thing a sweep varies.

Placements (x is the residual stream, F a sublayer, N the norm):
- pre       x = x + F(N(x))                      GPT-2, LLaMA
- post      x = N(x + F(x))                      Vaswani et al. 2017
- sandwich  x = x + N_out(F(N_in(x)))            Ding et al. 2021 (CogView), NormFormer-like
- deepnorm  x = N(alpha * x + F(x)), alpha = (2N_layers)^(1/4)   Wang et al. 2022 (DeepNet)
Absent norms are nn.Identity so every Block has the same module tree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stabilize.model.config import GPTConfig
from stabilize.model.recompute import recomputed
from stabilize.norms import build_norm


def norm_or_identity(present: bool, dim: int, cfg: GPTConfig) -> nn.Module:
    return build_norm(dim, cfg.norm) if present else nn.Identity()


def deepnorm_alpha(n_layer: int) -> float:
    """DeepNet's residual scale for a decoder-only stack of N layers: (2N)^(1/4)."""
    return (2 * n_layer) ** 0.25


def deepnorm_beta(n_layer: int) -> float:
    """DeepNet's init gain for v, out-proj and FFN weights in a decoder-only stack: (8N)^(-1/4)."""
    return (8 * n_layer) ** -0.25


class ScaledDotProduct(nn.Module):
    """Causal ``softmax(q k^T / sqrt(d)) v``: the attention scores, their softmax and the
    weighted sum of the values. A module of its own (``h.N.attn.scores``) so that it is a
    precision site (model/fp32_sites.py: switched to fp32, the scores and the softmax run
    in fp32 under autocast) and its output can be read, hooked or rounded like any other."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # q, k, v stacked
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.q_norm = norm_or_identity(cfg.norm.qk_norm, cfg.head_dim, cfg)
        self.k_norm = norm_or_identity(cfg.norm.qk_norm, cfg.head_dim, cfg)
        self.scores = ScaledDotProduct(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 x [B, T, C]
        # [B, T, C] -> [B, H, T, C/H]
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        y = self.scores(q, k, v).transpose(1, 2).reshape(b, t, c)  # [B, H, T, C/H] -> [B, T, C]
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.c_fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.placement = cfg.norm.placement
        d = cfg.d_model
        self.ln_1 = build_norm(d, cfg.norm)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = build_norm(d, cfg.norm)
        self.mlp = MLP(cfg)
        sandwich = self.placement == "sandwich"
        self.ln_1_out = norm_or_identity(sandwich, d, cfg)
        self.ln_2_out = norm_or_identity(sandwich, d, cfg)
        self.alpha = deepnorm_alpha(cfg.n_layer) if self.placement == "deepnorm" else 1.0
        # recompute this forward in the backward (stabilize/model/recompute.py)
        self.activation_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return recomputed(self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement in ("pre", "sandwich"):
            x = x + self.ln_1_out(self.attn(self.ln_1(x)))
            return x + self.ln_2_out(self.mlp(self.ln_2(x)))
        if self.alpha != 1.0:  # deepnorm
            x = self.ln_1(x * self.alpha + self.attn(x))
            return self.ln_2(x * self.alpha + self.mlp(x))
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))
