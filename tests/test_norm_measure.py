"""A norm found by what it does, not by what it is called: nanoGPT's ``LayerNorm`` (a weight,
an optional bias, eps 1e-5 inside ``forward``, no ``eps`` attribute; tests/your_nanogpt.py) is
found, its eps measured, and swapped for ours with the same Parameters. Checked against
references computed here: at fp32 the swapped model's every norm output and its logits are
bit-equal to the original's; at fp16 the swapped norm's reduction really is fp16 (the rows
whose float64 sum of fp16-rounded squares passes 65520 come out dead, the others match a
float64 LayerNorm), where the original stays finite. Norms that no module holds
(``F.layer_norm`` / ``F.rms_norm`` inside a block's forward) are said in one line, never
silently left out."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from your_nanogpt import LayerNorm, build

import stabilize
from stabilize.norms import Norm, find_norms, swap_norms

D, V = 64, 256
FP16_INF_FROM = 65520.0  # the smallest float64 sum that fp16 rounds to inf
NAMES = [*(f"transformer.h.{i}.{n}" for i in range(2) for n in ("ln_1", "ln_2")),
         "transformer.ln_f"]  # fmt: skip


def nanogpt(bias=True):
    model = build(bias=bias)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # gains and shifts that are not ones and zeros
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.weight.copy_(1.0 + 0.2 * torch.randn(D, generator=g))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(D, generator=g))
    return model


def ids(seed=1):
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(seed))


def _layernorm64(x, w, b, eps=1e-5):
    """LayerNorm from its definition, in float64."""
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = xc / torch.sqrt(xc.square().mean(-1, keepdim=True) + eps) * w.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_a_norm_with_eps_inside_forward_is_found_with_its_eps_measured(bias):
    found = find_norms(nanogpt(bias))
    assert [f.name for f in found] == NAMES
    for f in found:
        assert (f.cls, f.kind, f.width, f.bias, f.swappable) == ("LayerNorm", "layernorm", D,
                                                                  bias, True)  # fmt: skip
        assert (f.eps, f.eps_from, f.reduction_dtype) == (1e-5, "measured", "fp32")
    lines = stabilize.inspect_model(nanogpt(bias)).describe()
    assert lines[0] == "GPT: 2 blocks, 5 norms"
    assert "norms: LayerNorm (layernorm, eps 1e-05 measured)" in lines


@torch.no_grad()
def test_swapped_at_fp32_the_norms_and_the_logits_are_bit_equal():
    model = nanogpt()
    inputs = {}
    for n in NAMES:
        model.get_submodule(n).register_forward_pre_hook(
            lambda m, a, n=n: inputs.__setitem__(n, a[0].clone())
        )
    before = model(ids())
    outputs = {n: model.get_submodule(n)(inputs[n]) for n in NAMES}
    params = dict(model.named_parameters())
    assert swap_norms(model) == NAMES
    assert all(isinstance(model.get_submodule(n), Norm) for n in NAMES)
    after = dict(model.named_parameters())  # the same Parameter objects, the same names
    assert after.keys() == params.keys() and all(after[k] is p for k, p in params.items())
    for n in NAMES:
        new = model.get_submodule(n)
        assert new.eps == 1e-5 and new.reduction_dtype == "fp32"
        assert torch.equal(new(inputs[n]), outputs[n]), n
    assert torch.equal(model(ids()), before)


@torch.no_grad()
def test_swapped_at_fp16_the_reduction_overflows_where_float64_says_it_must():
    original = nanogpt()
    model = nanogpt()
    assert swap_norms(model, reduction_dtype="fp16") == NAMES
    assert all(f.reduction_dtype == "fp16" for f in find_norms(model))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, D, generator=g)
    x[2, 5], x[6, 0] = 300.0, -280.0  # |x| > 256: one fp16 square overflows
    x[4] *= 40.0  # RMS 40 > 255.94 / sqrt(64) = 32: the sum of 64 squares overflows
    xc = x.half().double() - x.half().double().mean(-1, keepdim=True)
    ss = xc.half().double().square().half().double().sum(-1)  # fp16-rounded, summed exactly
    assert ((ss - FP16_INF_FROM).abs() > 0.05 * FP16_INF_FROM).all()  # no borderline row
    over = ss >= FP16_INF_FROM
    assert over.tolist() == [i in (2, 4, 6) for i in range(8)]
    for n in NAMES:
        old, new = original.get_submodule(n), model.get_submodule(n)
        ref = _layernorm64(x, old.weight, old.bias)
        y = new(x.half())
        assert y.dtype == torch.float16
        dead = (y.double() == old.bias.detach().half().double()).all(-1)  # x * rsqrt(inf) + b
        assert dead.tolist() == over.tolist(), n
        torch.testing.assert_close(y[~over].double(), ref[~over], rtol=2e-2, atol=2e-2)
        # the original reduces in fp32: the same rows stay alive and right
        torch.testing.assert_close(old(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_inline_norms_are_said_in_one_line_never_silently():
    model = build(inline=True)
    with pytest.warns(UserWarning) as w:
        swapped = swap_norms(model, reduction_dtype="fp16")
    assert swapped == ["transformer.ln_f"]  # the one module that holds a norm
    (msg,) = [str(x.message) for x in w if str(x.message).startswith("swap_norms")]
    assert "\n" not in msg and "InlineBlock.forward" in msg and "F.layer_norm, F.rms_norm" in msg
    assert "transformer.h.0" in msg and "neither probed nor swappable" in msg
    lines = stabilize.inspect_model(build(inline=True)).describe()
    assert sum("computed inline" in line for line in lines) == 1


def test_nothing_to_swap_is_said_in_one_line():
    mlp = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
    with pytest.warns(UserWarning, match=r"swap_norms: nothing swapped in Sequential: no module "):
        assert swap_norms(mlp, reduction_dtype="fp16") == []
    (line,) = [x for x in stabilize.inspect_model(mlp).describe() if x.startswith("norms")]
    assert line == "norms: none found (no module normalizes its input's last dimension)"


class Scale(nn.Module):  # a 1-D weight that is no norm: measured, and left alone
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((D,), 2.0))

    def forward(self, x):
        return x * self.weight


def test_a_leaf_with_a_weight_that_does_not_normalize_is_no_norm():
    model = nn.Sequential(Scale(), nn.BatchNorm1d(D), nn.GroupNorm(4, D), LayerNorm(D, True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a norm is found: nothing to warn of
        found = [(f.name, f.kind, f.swappable) for f in find_norms(model)]
    # GroupNorm normalizes groups of channels (dim 1), not the last dimension: refused
    assert found == [("2", "unknown", False), ("3", "layernorm", True)]
    assert model[1].num_batches_tracked == 0  # BatchNorm's running statistics never moved
