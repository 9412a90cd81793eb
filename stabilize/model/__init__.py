"""The configurable GPT: pure ``nn.Module``s (no Lightning, Hydra, W&B or torch.distributed)."""

from stabilize.model.config import PRESETS, GPTConfig
from stabilize.model.foreign import ModelMap, inspect_model
from stabilize.model.gpt import GPT
from stabilize.model.layers import MLP, Block, CausalSelfAttention
from stabilize.model.recompute import set_activation_checkpointing


def build_model(cfg: GPTConfig):
    """Our GPT, or with ``model.hf`` a Hugging Face architecture (model/hf_arch.py)."""
    if cfg.hf is not None:
        from stabilize.model.hf_arch import build_hf

        model = build_hf(cfg)
    else:
        model = GPT(cfg)
    if cfg.fp32_modules:  # model.fp32_modules: precision sites switched to fp32
        from stabilize.model.fp32_sites import apply_fp32_modules

        apply_fp32_modules(model, cfg.fp32_modules)
    return model


__all__ = [
    "GPT",
    "build_model",
    "GPTConfig",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "set_activation_checkpointing",
    "inspect_model",
    "ModelMap",
]
