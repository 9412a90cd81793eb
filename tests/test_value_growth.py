"""``fault=value_growth`` (stabilize/faults/value_growth.py): one attention's ``c_proj``
input grows by f(t) while the model's function does not change; the formats scenario's
growth (configs/experiment/formats.yaml, docs/formats.md)."""

from __future__ import annotations

import math

import pytest
import torch

from stabilize.faults import FaultInjector, ValueGrowth, fault_config
from stabilize.model.config import GPTConfig
from stabilize.model.gpt import GPT
from stabilize.train import run
from stabilize.validate import ConfigError

from conftest import FAST, compose_run, read_csv_metrics, series


def test_f_is_geometric_from_its_step_and_holds_at_the_target():
    fault = ValueGrowth(fault_config(kind="value_growth", step=3, rate=2.0, target=10.0))
    assert [fault.planned(s) for s in range(1, 8)] == [1.0, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_with_accel_the_step_ratio_rises_by_it_each_step_by_hand():
    fault = ValueGrowth(fault_config(kind="value_growth", step=2, rate=1.0, accel=0.5, target=20))
    f = [fault.planned(s) for s in range(1, 7)]
    # ratios 1, 1.5, 2, 2.5, 3 from step 2: f = 1, 1.5, 3, 7.5, then 22.5, held at 20
    assert f == [1.0, 1.0, 1.5, 3.0, 7.5, 20.0] and fault.planned(7) == 20.0


@pytest.mark.parametrize(
    ("knob", "value", "said"),
    [("rate", 1.0, "fault.rate=1.0 is not allowed; must be > 1"),
     ("accel", -0.1, "fault.accel=-0.1 is not allowed; must be in"),
     ("rate", -2.0, "fault.rate=-2.0 is not allowed; must be a positive"),
     ("target", 0.5, "fault.target=0.5 is not allowed; must be >= 1")],
)  # fmt: skip
def test_bad_knobs_are_one_line_each(knob, value, said):
    with pytest.raises(ConfigError, match=said):
        fault_config(kind="value_growth", **{knob: value})


def test_the_function_is_unchanged_and_c_proj_sees_its_input_times_f():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=256))
    inj = FaultInjector(fault_config(kind="value_growth", layer=1, step=2, rate=3.0, target=20))
    inj.attach(model)
    seen = []
    model.h[1].attn.c_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().abs().max())
    )
    idx = torch.randint(0, 256, (2, 16))
    for step in range(6):
        inj.begin(step)
        inj.fault.disabled = True
        plain = model(idx)
        inj.fault.disabled = False
        grown = model(idx)
        torch.testing.assert_close(grown, plain, rtol=1e-5, atol=1e-5)
        f = inj.fault.planned(step)
        assert float(seen[-1] / seen[-2]) == pytest.approx(f, rel=1e-5)
    assert inj.fault.planned(5) == 20.0 and inj.happened


def test_a_block_without_attention_projections_is_refused():
    model = torch.nn.Module()
    model.h = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    inj = FaultInjector(fault_config(kind="value_growth"))
    with pytest.raises(ConfigError, match="block 0 has no attn.c_attn and attn.c_proj"):
        inj.attach(model)


GROW = ["fault=value_growth", "fault.step=3", "fault.rate=2", "fault.target=64",
        "trainer.max_steps=10", "trainer.val_check_interval=100"]  # fmt: skip


def test_training_with_the_growth_equals_training_without_it_in_fp32(tmp_path):
    losses = []
    for name, extra in (("grown", []), ("plain", ["fault.enabled=false"])):
        out = tmp_path / name
        run(compose_run(out, [*FAST, *GROW, "precision=fp32", *extra]))
        losses.append(series(read_csv_metrics(out), "train/loss_step"))
    grown, plain = losses
    assert sorted(grown) == sorted(plain) and len(grown) == 10
    for step, value in plain.items():
        assert grown[step] == pytest.approx(value, rel=1e-5, abs=1e-5), step


def test_the_probe_sees_c_proj_input_grow_by_f_under_delayed_scaling(tmp_path):
    # lr ~0: the weights stay put, so the natural input is the same with and without the
    # growth, and the quantized input's amax is f times it, step by step
    amax = []
    for name, extra in (("grown", []), ("plain", ["fault.enabled=false"])):
        out = tmp_path / name
        run(compose_run(out, [*FAST, *GROW, "precision=fp32", "quant=fp8_delayed",
                              "quant.history=16", "optim.lr=1e-12", *extra]))  # fmt: skip
        amax.append(series(read_csv_metrics(out), "q_amax/h.0.attn.c_proj.x"))
    grown, plain = amax
    assert len(plain) == 10
    for step, value in plain.items():  # step: the optimizer steps taken; the forward's is +1
        f = min(2.0 ** max(step + 1 - 3 + 1, 0), 64.0)
        assert grown[step] / value == pytest.approx(f, rel=1e-4), step
    assert math.isclose(max(grown[s] / plain[s] for s in plain), 64.0, rel_tol=1e-4)
