"""The configurable GPT: pure ``nn.Module``s (no Lightning, Hydra, W&B or torch.distributed)."""

from stabilize.model.config import PRESETS, GPTConfig
from stabilize.model.foreign import ModelMap, inspect_model
from stabilize.model.gpt import GPT
from stabilize.model.layers import MLP, Block, CausalSelfAttention
from stabilize.model.recompute import set_activation_checkpointing

__all__ = [
    "GPT",
    "GPTConfig",
    "PRESETS",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "set_activation_checkpointing",
    "inspect_model",
    "ModelMap",
]
