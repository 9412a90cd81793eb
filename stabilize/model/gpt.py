"""The GPT: embeddings, a stack of Blocks, optional final norm, tied output head."""

from __future__ import annotations

import math

import torch
from torch import nn

from stabilize.model.config import GPTConfig
from stabilize.model.layers import Block, deepnorm_beta, norm_or_identity
from stabilize.model.logits import LogitSoftcap
from stabilize.norms import Norm


def apply_norm_sites(model: nn.Module, sites: dict[str, dict]) -> None:
    """``model.norm_sites``: each named norm's own reduction dtype / eps over the shared
    ``norm`` settings (a site not among the model's norms is refused, naming them)."""
    norms = {n: m for n, m in model.named_modules() if isinstance(m, Norm)}
    for site, kv in sites.items():
        if site not in norms:
            raise ValueError(
                f"model.norm_sites.{site} is not allowed: no norm of that name; allowed: "
                f"{sorted(norms)}"
            )
        for k, v in kv.items():
            setattr(norms[site], k, float(v) if k == "eps" else v)


class GPT(nn.Module):
    """With LayerNorm, pre placement, biases and gelu_tanh this is exactly GPT-2."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln_emb = norm_or_identity(cfg.norm.embed_norm, cfg.d_model, cfg)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = norm_or_identity(cfg.norm.final_norm, cfg.d_model, cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf 2017), as in GPT-2
        self.logit_softcap = LogitSoftcap(cfg.logit_softcap)  # a pass-through when off
        # the loss's z-loss coefficient (model/logits.py lm_loss): an attribute, not a
        # buffer, so a remedy can switch it on mid-run (rollback/remedies.py, z_loss)
        self.z_loss = cfg.z_loss
        self.reset_parameters()
        apply_norm_sites(self, cfg.norm_sites)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.cfg
        std = cfg.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Norm):
                m.reset_parameters()
        if cfg.norm.placement == "deepnorm":
            self._deepnorm_init()
        else:
            # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) (Radford et al. 2019).
            for block in self.h:
                for proj in (block.attn.c_proj, block.mlp.c_proj):
                    nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * cfg.n_layer))

    def _deepnorm_init(self) -> None:
        """DeepNet init: xavier-normal with gain beta on v, out-proj and FFN; gain 1 on q, k."""
        d, beta = self.cfg.d_model, deepnorm_beta(self.cfg.n_layer)
        for block in self.h:
            # [3C, C]: rows are q, k, v, each a [C, C] projection with its own fan-in/out
            q, k, v = block.attn.c_attn.weight.split(d)
            nn.init.xavier_normal_(q, gain=1.0)
            nn.init.xavier_normal_(k, gain=1.0)
            nn.init.xavier_normal_(v, gain=beta)
            for lin in (block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                nn.init.xavier_normal_(lin.weight, gain=beta)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [B, T] token ids -> logits [B, T, vocab]."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.ln_emb(self.drop(self.wte(idx) + self.wpe(pos)))  # [B, T, C]
        for block in self.h:
            x = block(x)
        return self.logit_softcap(self.lm_head(self.ln_f(x)))

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights once); ``non_embedding`` drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n
