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

        return build_hf(cfg)
    return GPT(cfg)


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
