"""Issue 37's planted silent fault (stabilize/faults/rounding.py): one site's output rounded
toward zero, checked against a float64 truncation computed by hand; its refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch

from stabilize.faults import FaultInjector, fault_config
from stabilize.faults.rounding import round_toward_zero
from stabilize.model import build_model
from stabilize.model.config import GPTConfig
from stabilize.validate import ConfigError


def _by_hand(v: float, bits: int) -> float:
    """|v| truncated to 1 + bits significant binary digits, sign kept (float64)."""
    if v == 0:
        return 0.0
    e = math.floor(math.log2(abs(v)))
    q = 2.0 ** (e - bits)
    return math.copysign(math.floor(abs(v) / q) * q, v)


@pytest.mark.parametrize("bits", [0, 1, 3, 7, 10])
def test_round_toward_zero_equals_a_float64_truncation(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2000, generator=g) * torch.logspace(-3, 3, 2000)
    got = round_toward_zero(x, bits)
    want = torch.tensor([_by_hand(v, bits) for v in x.double().tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert (got.abs() <= x.abs()).all() and (torch.sign(got) == torch.sign(x)).all()
    if bits <= 7:  # a bf16 input: truncated in fp32, exact in bf16 on the way back
        xb = x.bfloat16()
        want_b = [_by_hand(v, bits) for v in xb.double().tolist()]
        assert round_toward_zero(xb, bits).dtype == torch.bfloat16
        assert round_toward_zero(xb, bits).double().tolist() == want_b
    # 1.9375 = 1.1111b: 1.11b = 1.75 with 2 bits
    assert round_toward_zero(torch.tensor([1.9375, -1.9375]), 2).tolist() == [1.75, -1.75]


def test_the_site_rounds_its_output_from_its_step_and_passes_the_gradient():
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=2, d_model=32, n_head=2, block_size=16))
    inj = FaultInjector(fault_config({"kind": "biased_round", "site": "h.1.ln_1", "bits": 2,
                                      "step": 3}))  # fmt: skip
    inj.attach(model)
    seen = {}
    model.h[1].ln_1.register_forward_hook(lambda m, a, out: seen.update(out=out))
    x = torch.randint(0, 256, (2, 16))
    for step in (2, 3):
        inj.begin(step, step)
        model(x).sum().backward()
        out = seen["out"]
        rounded = torch.equal(out, round_toward_zero(out.detach(), 2))
        assert rounded == (step == 3), step  # not before its step, from it on
    assert inj.fault.fired == {3}
    # the backward passes through the site: its weight and the blocks before it get gradients
    assert model.h[1].ln_1.weight.grad is not None and model.h[1].ln_1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"bits": 23}, "fault.bits=23 is not allowed; allowed: an int in [0, 22]"),
        ({"persistent": False},
         "fault.persistent=False is not allowed with fault.kind=biased_round"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line(settings, words):
    with pytest.raises((ConfigError, ValueError), match=re.escape(words)):
        fault_config({"kind": "biased_round", **settings})


def test_a_site_that_is_not_a_module_is_refused_with_its_near_names():
    model = build_model(GPTConfig(n_layer=2, d_model=32, n_head=2, block_size=16))
    inj = FaultInjector(fault_config({"kind": "biased_round", "site": "h.7.ln_1"}))
    with pytest.raises(ConfigError, match=r"fault.site='h.7.ln_1' is not allowed; not a module"):
        inj.attach(model)
