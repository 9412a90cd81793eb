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


def test_the_sites_are_the_norms_and_linear_layers_in_order_and_a_bad_path_is_refused():
    assert sites(_model()) == [
        "h.0.ln_1", "h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.ln_2", "h.0.mlp.c_fc",
        "h.0.mlp.c_proj", "h.1.ln_1", "h.1.attn.c_attn", "h.1.attn.c_proj", "h.1.ln_2",
        "h.1.mlp.c_fc", "h.1.mlp.c_proj", "ln_f", "lm_head",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"model.fp32_modules: 'h.9.ln_1' is not allowed: not a "
                       r"module of the model; its sites: \['h.0.ln_1'"):  # fmt: skip
        _model(fp32_modules=["h.9.ln_1"])
    with pytest.raises(ValueError, match=r"model.fp32_modules='lm_head' is not allowed; expected"):
        GPTConfig(fp32_modules="lm_head")
