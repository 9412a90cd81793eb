"""A user's model written as nanoGPT writes it (karpathy/nanoGPT ``model.py``, trimmed to what
the harness sees): its ``LayerNorm`` holds a weight and an optional bias and keeps eps inside
``forward`` (``F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)``), with
no ``eps`` attribute; its attention is one fused ``c_attn`` with ``n_head`` and ``n_embd``.
``inline=True`` builds the same model with its norms computed inline in each block's
``forward`` (``F.layer_norm``, and a module-level ``norm`` helper around ``F.rms_norm`` as
modded-nanogpt writes it): no module holds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


def norm(x):  # modded-nanogpt's: a function, no module, no weight
    return F.rms_norm(x, (x.size(-1),))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class InlineBlock(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(F.layer_norm(x, x.shape[-1:]))
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64,
                 bias=True, inline=False):  # fmt: skip
        super().__init__()
        kind = InlineBlock if inline else Block
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([kind(n_embd, n_head, bias) for _ in range(n_layer)]),
                ln_f=LayerNorm(n_embd, bias=bias),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            if name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(**kw)
