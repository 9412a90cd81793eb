"""Issue 37's optimizer-state site (stabilize/lit/optim_state.py, ``optim.state_dtype``):
AdamW's moments kept at bf16's precision, checked against a float64 AdamW computed by hand,
and the gap bisection counts it as a site of the run."""

from __future__ import annotations

import torch

from stabilize.lit.optim_state import round_moments_to_bf16
from stabilize.replay.gap_bisect import OPTIM_STATE, run_sites
from stabilize.run.config import OptimConfig

B1, B2 = 0.9, 0.95


def _steps(hook: bool, grads: list[torch.Tensor]) -> torch.optim.AdamW:
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(B1, B2), weight_decay=0.0)
    if hook:
        opt.register_step_post_hook(round_moments_to_bf16)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return opt


def test_the_moments_are_bf16_after_each_step_as_a_float64_adam_says():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(512, generator=g) * 10 ** torch.empty(512).uniform_(-4, 1, generator=g)
             for _ in range(3)]  # fmt: skip
    st = next(iter(_steps(True, grads).state.values()))
    plain = next(iter(_steps(False, grads).state.values()))
    # by hand in float64, each moment rounded to bf16 after its step
    m = v = torch.zeros(512, dtype=torch.float64)
    for x in grads:
        x = x.double()
        m = (B1 * m + (1 - B1) * x).bfloat16().double()
        v = (B2 * v + (1 - B2) * x * x).bfloat16().double()
    for got, want in ((st["exp_avg"], m), (st["exp_avg_sq"], v)):
        assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())
        # within one bf16 spacing (2^-8 relative) of the float64 reference: fp32's own
        # arithmetic may round the other way at a tie
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-30).all()
    assert not torch.equal(st["exp_avg_sq"], plain["exp_avg_sq"])  # the knob does something


def test_the_bisection_counts_the_state_as_a_site_only_when_it_is_not_fp32():
    class Cfg:
        optim = OptimConfig(state_dtype="bf16")

    assert run_sites(Cfg) == [OPTIM_STATE]
    Cfg.optim = OptimConfig()
    assert run_sites(Cfg) == []
