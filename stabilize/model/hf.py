"""Convert state dicts between this GPT and Hugging Face's ``GPT2LMHeadModel`` layout.

GPT-2 stores its projections as ``Conv1D`` modules whose weights are [in, out], the
transpose of ``nn.Linear``'s [out, in]; names otherwise match ours under ``transformer.``.
No import of ``transformers`` here: only tensors and names.
"""

from __future__ import annotations

import torch

from stabilize.model.config import GPTConfig

_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def check_gpt2_compatible(cfg: GPTConfig) -> None:
    """GPT-2 is LayerNorm (affine, with bias), pre-norm with a final norm, biases, gelu_tanh."""
    n = cfg.norm
    want = {
        "norm.type": (n.type, "layernorm"),
        "norm.placement": (n.placement, "pre"),
        "norm.affine": (n.affine, True),
        "norm.bias": (n.bias, True),
        "norm.final_norm": (n.final_norm, True),
        "norm.embed_norm": (n.embed_norm, False),
        "norm.qk_norm": (n.qk_norm, False),
        "model.bias": (cfg.bias, True),
        "model.activation": (cfg.activation, "gelu_tanh"),
        "model.logit_softcap": (cfg.logit_softcap, 0.0),  # changes the outputs
    }
    bad = [f"{k}={v!r} (GPT-2 needs {w!r})" for k, (v, w) in want.items() if v != w]
    if bad:
        raise ValueError("config is not GPT-2's architecture: " + "; ".join(bad))


def gpt2_config_kwargs(cfg: GPTConfig) -> dict:
    """Keyword arguments for ``transformers.GPT2Config`` describing the same network."""
    check_gpt2_compatible(cfg)
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.mlp_ratio * cfg.d_model,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm.eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=True,
    )


def to_hf_gpt2(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> ``GPT2LMHeadModel`` state dict."""
    check_gpt2_compatible(cfg)
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight":
            out[k] = v
            continue
        out["transformer." + k] = v.t().contiguous() if k.endswith(_CONV1D) else v
    return out


def from_hf_gpt2(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` state dict -> ours (drops the causal-mask buffers old ones carry)."""
    check_gpt2_compatible(cfg)
    out = {}
    for k, v in state.items():
        if k.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # registered causal masks in older transformers versions, not weights
        name = k.removeprefix("transformer.")
        out[name] = v.t().contiguous() if name.endswith(_CONV1D) else v
    out.setdefault("lm_head.weight", out["wte.weight"])
    return out
