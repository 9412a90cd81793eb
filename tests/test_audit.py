"""The norm audit's float64 reference, against PyTorch's own kernels and the definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stabilize.lit.audit import reference64
from stabilize.norms import NormConfig, build_norm


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "scalenorm"])
def test_reference64_matches_torch_and_the_definition(kind):
    torch.manual_seed(0)
    norm = build_norm(48, NormConfig(type=kind, eps=1e-3))
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = 5 * torch.randn(7, 48) + 1.0
    ref = reference64(norm, x)
    assert ref.dtype == torch.float64
    x64 = x.double()
    if kind == "layernorm":
        want = F.layer_norm(x64, (48,), norm.weight.double(), norm.bias.double(), 1e-3)
    elif kind == "rmsnorm":
        want = F.rms_norm(x64, (48,), norm.weight.double(), 1e-3)
    else:  # Nguyen & Salazar 2019: g x / ||x||, eps inside the root
        want = norm.weight.double() * x64 / torch.sqrt((x64**2).sum(-1, keepdim=True) + 1e-3)
    torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-12)


def test_reference64_rms_row_norm_is_sqrt_d_only_when_eps_is_negligible():
    norm = build_norm(64, NormConfig(type="rmsnorm", eps=1e-3))
    big, small = torch.randn(1, 64), 0.01 * torch.randn(1, 64)
    assert float(reference64(norm, big).norm()) == pytest.approx(math.sqrt(64), rel=1e-3)
    ms = float((small.double() ** 2).mean())
    expect = math.sqrt(64) * math.sqrt(ms / (ms + 1e-3))  # eps flattens small rows
    assert float(reference64(norm, small).norm()) == pytest.approx(expect, rel=1e-9)
    assert expect < 0.95 * math.sqrt(64)
