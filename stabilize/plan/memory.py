"""Per-GPU memory of one training step, from the model's own ops (docs/memory.md).

Model state is counted exactly: ``param_shapes`` lists every parameter the GPT builds (a test
compares it, name by name, with the model built on the meta device), and each byte figure is
a count times a dtype size. Activations are the tensors autograd saves for backward in one
micro-batch, derived op by op from stabilize/model/layers.py and gpt.py for the kernels the
harness runs (fused norms, ``F.scaled_dot_product_attention``'s flash kernel, an assumption
the plan prints with the memory without it); a test checks the formula against the bytes
autograd actually saves on CPU.

Dtypes, as Lightning runs them (stabilize/lit/build.py):
- ``fp32`` and ``*-mixed``: parameters, gradients and AdamW moments are fp32 (mixed precision
  keeps the fp32 parameters as the master weights and autocasts the matmuls).
- ``bf16-true``: the module itself is bf16, so are its gradients and AdamW's moments; there
  is no fp32 master copy.
- Under autocast each Linear's weight is cast to 16 bits once per forward and the copy is
  saved for backward: 2 bytes per matmul weight, alive from forward to backward.
- The residual stream stays fp32 under ``*-mixed``: embedding lookups are not autocast, and
  adding a 16-bit sublayer output to an fp32 tensor promotes to fp32. A norm's output is in
  the activation dtype, so an embedding norm (``norm.embed_norm``) makes the stream 16-bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabilize.model import GPTConfig
from stabilize.norms import get_norm_type

PARAM_BYTES = {"fp32": 4, "fp16-mixed": 4, "bf16-mixed": 4, "bf16-true": 2}
ACT_BYTES = {"fp32": 4, "fp16-mixed": 2, "bf16-mixed": 2, "bf16-true": 2}
ACT_DTYPE = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
INDEX_BYTES = 8  # int64 token ids and targets
STAT_BYTES = 4  # a fused norm's per-row statistics and the attention's logsumexp: fp32
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq, each in the parameter's dtype


def _norm_params(prefix: str, dim: int, m: GPTConfig) -> dict[str, tuple[int, ...]]:
    spec = get_norm_type(m.norm.type)
    if not m.norm.affine:
        return {}
    out = {f"{prefix}.weight": tuple(spec.weight_shape(dim))}
    if spec.has_bias and m.norm.bias:
        out[f"{prefix}.bias"] = (dim,)
    return out


def _linear(prefix: str, n_in: int, n_out: int, bias: bool) -> dict[str, tuple[int, ...]]:
    out = {f"{prefix}.weight": (n_out, n_in)}
    if bias:
        out[f"{prefix}.bias"] = (n_out,)
    return out


def param_shapes(m: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``GPT(m)`` by its ``named_parameters`` name (the tied head is
    ``wte.weight`` once), from the layer definitions, without building anything."""
    d, hidden = m.d_model, m.mlp_ratio * m.d_model
    shapes = {"wte.weight": (m.vocab_size, d), "wpe.weight": (m.block_size, d)}
    if m.norm.embed_norm:
        shapes |= _norm_params("ln_emb", d, m)
    for i in range(m.n_layer):
        h = f"h.{i}"
        shapes |= _norm_params(f"{h}.ln_1", d, m)
        shapes |= _linear(f"{h}.attn.c_attn", d, 3 * d, m.bias)
        shapes |= _linear(f"{h}.attn.c_proj", d, d, m.bias)
        if m.norm.qk_norm:
            shapes |= _norm_params(f"{h}.attn.q_norm", m.head_dim, m)
            shapes |= _norm_params(f"{h}.attn.k_norm", m.head_dim, m)
        shapes |= _norm_params(f"{h}.ln_2", d, m)
        shapes |= _linear(f"{h}.mlp.c_fc", d, hidden, m.bias)
        shapes |= _linear(f"{h}.mlp.c_proj", hidden, d, m.bias)
        if m.norm.placement == "sandwich":
            shapes |= _norm_params(f"{h}.ln_1_out", d, m)
            shapes |= _norm_params(f"{h}.ln_2_out", d, m)
    if m.norm.final_norm:
        shapes |= _norm_params("ln_f", d, m)
    return shapes


def param_count(m: GPTConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(m).values())


def matmul_weight_count(m: GPTConfig) -> int:
    """Elements of the weights autocast casts to 16 bits: every Linear's, the tied head's."""
    per_block = (3 + 1 + 2 * m.mlp_ratio) * m.d_model**2
    return m.n_layer * per_block + m.vocab_size * m.d_model


def shard_count(m: GPTConfig, world: int) -> int:
    """Elements of the largest rank's shard under FSDP2, which splits every parameter along
    dim 0 and pads it to a multiple of the world size (rank 0 holds ceil(dim0 / world) rows)."""
    return sum(
        math.ceil((s[0] if s else 1) / world) * math.prod(s[1:]) for s in param_shapes(m).values()
    )


@dataclass
class ModelState:
    """Bytes per GPU of what lives across steps."""

    n_params: int
    params: int
    grads: int
    optimizer: int  # AdamW's two moments
    autocast_copies: int  # 16-bit weight copies, forward to backward (mixed precision)
    fsdp_gather: int  # unsharded working set under FSDP (0 under DDP)


def model_state(m: GPTConfig, precision: str, strategy: str, world: int) -> ModelState:
    """Parameters, gradients and AdamW moments per GPU; under FSDP each rank keeps its shard,
    and gathers two blocks' parameters (the one running and the prefetched next) and one
    block's gradients (before the reduce-scatter) at a time."""
    pb = PARAM_BYTES[precision]
    n = param_count(m)
    mine = shard_count(m, world) if strategy == "fsdp" else n
    copies = 2 * matmul_weight_count(m) if precision.endswith("-mixed") else 0
    gather = 0
    if strategy == "fsdp":
        per_block = sum(math.prod(s) for k, s in param_shapes(m).items() if k.startswith("h.0."))
        gather = 3 * per_block * pb
    return ModelState(n, mine * pb, mine * pb, ADAM_MOMENTS * mine * pb, copies, gather)


@dataclass
class Activations:
    """Bytes per GPU for one micro-batch of ``batch`` sequences of ``seq`` tokens."""

    per_layer: int  # saved by one block
    embedding: int  # token and position ids
    head: int  # final norm, the head's input, fp32 log-probabilities, targets
    saved: int  # all saved tensors, no checkpointing: what autograd holds at the loss
    loss_peak: int  # transient at the loss, on top of ``saved`` (not saved for backward)
    checkpointed: int  # saved with per-block recompute, plus one block recomputed
    checked: bool  # False where the formula is not checked by tests/test_plan.py (``notes``)
    notes: list[str]
    # what one block saves more when SDPA runs its math path instead of a fused (flash or
    # memory-efficient) kernel: the plan assumes a fused one
    math_attention: int = 0

    @property
    def peak(self) -> int:
        return self.saved + self.loss_peak

    @property
    def peak_checkpointed(self) -> int:
        return self.checkpointed + self.loss_peak

    def without_fused_attention(self, n_layer: int) -> tuple[int, int]:
        """(peak, peak with per-block recompute) if attention ran SDPA's math path."""
        return self.peak + n_layer * self.math_attention, self.peak_checkpointed + (
            self.math_attention
        )


def _norm_saves(m: GPTConfig, in_dtype: str, act: int) -> tuple[int, int, int]:
    """What one norm saves for backward, per row element and per row, given its input's dtype:
    (bytes of the input as saved, extra bytes, bytes per row).

    Kernel backends (torch, fused, apex) save the input tensor itself (they reduce in fp32
    internally, so nothing is cast) and per-row fp32 statistics (LayerNorm: mean and 1/std;
    RMS-like types: 1/rms). The written-out ``explicit`` form saves its input cast to the
    reduction dtype (a copy when the dtypes differ) and its normalized result before gamma."""
    red = m.norm.reduction_dtype
    stats = (2 if get_norm_type(m.norm.type).has_bias else 1) * STAT_BYTES
    if m.norm.backend != "explicit" or red in ("input", in_dtype):
        saved_in = DTYPE_BYTES[in_dtype]
    else:
        saved_in = DTYPE_BYTES[red]
    extra = act if m.norm.backend == "explicit" and m.norm.affine else 0
    return saved_in, extra, stats


def activations(m: GPTConfig, precision: str, batch: int, seq: int | None = None) -> Activations:
    """Saved-for-backward bytes of one micro-batch, op by op (bytes per token x tokens).

    A pre-norm block (layers.py), x the residual stream (r bytes per element), a the
    activation dtype's size, D = d_model, m = mlp_ratio, H = heads:
      ln_1 input x (r)  + ln_1 output (a, c_attn's input) + qkv (3a: q, k, v are views of
      c_attn's output, saved by SDPA) + SDPA output (a; the flash kernel lays it out
      [B, T, H, hd], so c_proj's [B, T, D] input is a view of it) + logsumexp (4 per head)
      + residual after attention (r, ln_2's input) + ln_2 output (a) + c_fc output (m a,
      GELU's input) + GELU output (m a, c_proj's input) + per-row norm statistics
    = (2r + (6 + 2m) a) D + 4H + norm statistics, bytes per token. Dropout 0 (every preset):
    no masks. Head: ln_f's input (r) and output (a), the fp32 log-probabilities (4V:
    cross-entropy in fp32 saves log_softmax's output) and the int64 targets; embeddings: the
    int64 ids.
    """
    seq = seq or m.block_size
    tokens = batch * seq
    d, v = m.d_model, m.vocab_size
    a = ACT_BYTES[precision]
    act = ACT_DTYPE[precision]
    emb = "fp32" if PARAM_BYTES[precision] == 4 else "bf16"  # the embedding sum's dtype
    resid = act if m.norm.embed_norm else emb  # a norm's output is in the activation dtype
    r = DTYPE_BYTES[resid]
    notes: list[str] = []
    checked = True
    if m.norm.backend == "explicit":
        notes.append("norm.backend=explicit: its input cast and pre-gamma result counted")

    n_in, n_extra, n_row = _norm_saves(m, resid, a)
    norm = (n_in + n_extra) * d + n_row  # ln_1 and ln_2, each with its input
    block = 2 * norm + (6 + 2 * m.mlp_ratio) * a * d + STAT_BYTES * m.n_head
    if m.norm.qk_norm:
        # q and k normalized per head: their inputs are views of qkv (already counted) unless
        # cast; their outputs (2a) are SDPA's q, k; v, now laid out unlike them, is copied (a).
        q_in, q_extra, q_row = _norm_saves(m, act, a)
        cast = q_in if q_in != a else 0
        block += 2 * ((cast + q_extra) * d + q_row * m.n_head) + 3 * a * d
    if m.norm.placement != "pre":
        checked = False
        notes.append(f"norm.placement={m.norm.placement}: planned like pre (approximate)")
    if m.dropout > 0:
        checked = False
        block += 3 * d  # bool masks of the residual dropouts; attention dropout not planned
        notes.append("model.dropout > 0: dropout masks approximated, attention dropout not")
    embedding = INDEX_BYTES * (tokens + seq)  # token ids, position ids
    if m.norm.embed_norm:
        e_in, e_extra, e_row = _norm_saves(m, emb, a)
        embedding += ((e_in + e_extra) * d + e_row) * tokens
    head = INDEX_BYTES + 4 * v  # targets, fp32 log-probabilities
    if m.norm.final_norm:
        head += norm + a * d  # ln_f with its input, and its output (the head's input)
    else:
        head += a * d  # the head's input: the stream itself, or its autocast copy
    per_layer = block * tokens
    head_bytes = head * tokens + 4  # + the loss scalar
    saved = m.n_layer * per_layer + embedding + head_bytes
    # Per-block recompute (torch.utils.checkpoint, non-reentrant): each block keeps only its
    # input; during backward one block's saved set is rebuilt at a time.
    checkpointed = m.n_layer * r * d * tokens + per_layer + embedding + head_bytes
    # At the loss: forward, the head's logits (a V) and their fp32 copy (4 V; none in fp32)
    # are alive while log_softmax writes the saved log-probabilities; backward, nll_loss's
    # gradient (4 V) and log_softmax's (4 V) are alive beside them: 8 V bytes per token.
    loss_peak = 8 * v * tokens
    # SDPA's math path (no fused kernel: e.g. a GPU before Ampere, a head size the kernels
    # refuse) saves the softmax's fp32 attention weights (4 H T bytes per token, T the
    # sequence), fp32 copies of 16-bit inputs (6 D) and no logsumexp; measured on CPU with
    # torch 2.13 (tests/test_plan.py)
    math = (4 * m.n_head * seq + (6 * d if a == 2 else 0) - STAT_BYTES * m.n_head) * tokens
    return Activations(
        per_layer, embedding, head_bytes, saved, loss_peak, checkpointed, checked, notes, math
    )
