"""A user's plain-loop model (issue 36, "Done when" 2): Hugging Face's LlamaForCausalLM, 2
layers 64 wide, built from a config (no download), its RMSNorms swapped for ours reducing in
fp16 (``stabilize.swap_norms``), and its loss. Importable by path (``your_llama:build``,
``your_llama:lm_loss``), so that ``stabilize-replay`` can rebuild both in another process.
Weights drawn at std 0.04, not Hugging Face's 0.02: at 0.02 the test's drift put every row
of every norm it reached past the fp16 line (256 of 256), at 0.04 a few rows stay under it
(247-252 of 256), so the per-row counts are tested on rows that differ."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stabilize


def build(reduction_dtype: str = "fp16"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa",
                      initializer_range=0.04)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    stabilize.swap_norms(model, reduction_dtype=reduction_dtype)
    return model


def lm_loss(model, batch):
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
