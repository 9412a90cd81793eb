"""Issue 37's precision sites (stabilize/model/fp32_sites.py): a module switched to fp32
computes in fp32 under 16-bit autocast (against a float64 reference), a deep copy keeps the
switch on its own weights, and a bad path is refused naming the model's sites."""

from __future__ import annotations

import copy

import pytest
import torch

from stabilize.model import build_model
from stabilize.model.config import GPTConfig
from stabilize.model.fp32_sites import is_fp32, sites


def _model(**kw):
    torch.manual_seed(0)
    return build_model(GPTConfig(n_layer=2, d_model=64, n_head=2, block_size=16, **kw))


def test_a_switched_linear_computes_in_fp32_under_bf16_autocast():
    m = _model(fp32_modules=["h.0.mlp.c_fc", "h.1.ln_1"])
    fc, other = m.h[0].mlp.c_fc, m.h[1].mlp.c_fc
    assert is_fp32(fc) and not is_fp32(other) and m.h[1].ln_1.reduction_dtype == "fp32"
    x = torch.randn(4, 64)
    want = x.double() @ fc.weight.double().T + fc.bias.double()  # float64, by hand
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, plain = fc(x), other(x)
    assert got.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() < 1e-5
    want_other = x.double() @ other.weight.double().T + other.bias.double()
    assert (plain.double() - want_other).abs().max() > 1e-3  # bf16's rounding, for contrast


def test_a_deep_copy_keeps_the_switch_on_its_own_weights():
    m = _model(fp32_modules=["lm_head"])
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)  # tied: the copy's embedding too
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = m.lm_head(x), twin.lm_head(x)
    assert is_fp32(twin.lm_head) and b.dtype == torch.float32
    assert torch.allclose(b, 2 * a, rtol=1e-6, atol=1e-6)


def _attention64(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v in float64, by hand."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_the_attention_scores_and_softmax_are_a_site_of_their_own():
    """h.N.attn.scores switched: the scores, softmax and weighted sum in fp32 under bf16
    autocast (float64 agreement to fp32's precision); not switched: bf16's error."""
    m = _model(fp32_modules=["h.0.attn.scores"])
    on, off = m.h[0].attn.scores, m.h[1].attn.scores
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 16, 32) for _ in range(3))
    want = _attention64(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, plain = on(q.bfloat16(), k.bfloat16(), v.bfloat16()), off(q, k, v)
    assert got.dtype == torch.float32
    # the inputs were bf16: the reference is taken on the same rounded inputs
    ref = _attention64(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert (got.double() - ref).abs().max() < 1e-5
    assert (plain.double() - want).abs().max() > 1e-3  # bf16 compute, for contrast


def _layernorm64(x):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)


def test_under_bf16_true_a_switched_site_computes_in_fp32_and_returns_bf16():
    """bf16 weights, no autocast, norms reducing in their input's dtype: the switched norm
    reads its weights as fp32 copies and reduces in fp32 (one bf16 rounding of the float64
    result: 2^-8 relative), the other reduces in bf16 (its error is the size of the output);
    both outputs are bf16 for the next module, and the gradient reaches the bf16 weights."""
    m = _model(norm={"reduction_dtype": "input"}, fp32_modules=["h.0.ln_1"])
    m = m.to(torch.bfloat16)
    on, off = m.h[0].ln_1, m.h[1].ln_1
    assert on.reduction_dtype == "fp32" and off.reduction_dtype == "input"
    x = (torch.randn(8, 64) + 30).bfloat16()  # a large mean: a 16-bit variance cancels
    want = _layernorm64(x)
    got, plain = on(x), off(x)
    assert got.dtype == plain.dtype == torch.bfloat16 and on.weight.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()
    assert (plain.double() - want).abs().mean() > 10 * (got.double() - want).abs().mean()
    got.float().sum().backward()
    assert on.weight.grad is not None and on.weight.grad.dtype == torch.bfloat16
    m(torch.randint(0, 64, (2, 8))).float().sum().backward()  # the whole model runs


def test_the_sites_are_the_norms_and_linear_layers_in_order_and_a_bad_path_is_refused():
    assert sites(_model()) == [
        "h.0.ln_1", "h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.attn.scores", "h.0.ln_2",
        "h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.1.ln_1", "h.1.attn.c_attn", "h.1.attn.c_proj",
        "h.1.attn.scores", "h.1.ln_2", "h.1.mlp.c_fc", "h.1.mlp.c_proj", "ln_f", "lm_head",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"model.fp32_modules: 'h.9.ln_1' is not allowed: not a "
                       r"module of the model; its sites: \['h.0.ln_1'"):  # fmt: skip
        _model(fp32_modules=["h.9.ln_1"])
    with pytest.raises(ValueError, match=r"model.fp32_modules='lm_head' is not allowed; expected"):
        GPTConfig(fp32_modules="lm_head")
