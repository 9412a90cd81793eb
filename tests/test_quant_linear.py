"""``QuantLinear`` (stabilize/quant/linear.py), the recipes torchao does not train on CPU,
against hand computations: delayed scaling's scale from an amax history kept in the module's
state (so a rollback restores it), the quantized GEMM's forward and gradients, and the
probe's counts on a real plain-loop run (``Guard``) against a float64 simulation of the
history the test keeps itself; MX FLOOR clipping a block that RCEIL keeps; NVFP4 trains."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import stabilize
from stabilize.quant.linear import QuantLinear, swap_linears
from stabilize.validate import ConfigError

E4M3_MAX, E4M3_SAT = 448.0, 464.0  # past 464 a value changes when cast (half an ulp)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.float8_e4m3fn).double()


def test_delayed_scaling_takes_the_scale_from_the_history_and_keeps_it_in_the_state():
    torch.manual_seed(0)
    m = QuantLinear(32, 16, recipe="fp8_delayed", history=3)
    hist, scale = [0.0, 0.0, 0.0], 1.0  # Transformer Engine starts at scale 1
    w_scale = 1.0
    for step in range(5):
        x = torch.randn(4, 32) * (1.5**step)
        out = m(x)
        # by hand: the scales this step used, the casts, the matmul on dequantized values
        xq = _e4m3(x.double() * scale) / scale
        wq = _e4m3(m.weight.double() * w_scale) / w_scale
        want = xq @ wq.t() + m.bias.double()
        assert torch.allclose(out.double(), want, atol=1e-5), step
        hist = [*hist[1:], float(x.abs().max())]
        scale = E4M3_MAX / max(hist)
        w_scale = E4M3_MAX / float(m.weight.abs().max())  # the weight's history: constant
        assert math.isclose(float(m.scale[0]), scale, rel_tol=1e-6), (step, float(m.scale[0]))
        assert m.amax_history[0].tolist() == pytest.approx(hist)
    state = m.state_dict()
    assert {"amax_history", "scale"} <= set(state)  # a snapshot carries the history


def test_the_gradients_are_those_of_the_quantized_operands():
    torch.manual_seed(0)
    m = QuantLinear(32, 32, recipe="mxfp8")
    x = torch.randn(8, 32, requires_grad=True)
    m(x).square().sum().backward()
    from stabilize.quant.quantize import quantize

    xq = quantize(x, m.schemes[0]).dequantize()
    wq = quantize(m.weight, m.schemes[1]).dequantize()
    dy = 2 * (xq @ wq.t() + m.bias)
    dyq = quantize(dy, m.schemes[2]).dequantize()
    assert torch.allclose(x.grad, dyq @ wq, atol=1e-5)
    assert torch.allclose(m.weight.grad, dyq.t() @ xq, atol=1e-4)


def test_a_block_format_refuses_a_linear_its_blocks_cannot_split():
    model = torch.nn.Sequential(torch.nn.Linear(64, 40))
    with pytest.raises(ConfigError, match=r"quant.layers includes 0 \(64 -> 40\).*divisible by 32"):
        swap_linears(model, ["0"], "mxfp8")
    assert type(model[0]) is torch.nn.Linear  # nothing swapped


def _mlp(recipe: str, **knobs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    swap_linears(model, ["0", "2"], recipe, **knobs)
    return model


def _loss(model, batch):
    return (model(batch) - batch).square().mean()


def _logged(run_dir) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if k.startswith("q_") and v}
            if vals and row.get("train/step"):
                out.setdefault(int(float(row["train/step"])), {}).update(vals)
    return out


def test_a_growing_input_saturates_delayed_scaling_as_a_float64_history_says(tmp_path):
    """The input of layer 0 grows 30% a step: a scale from the last 4 steps' amax falls
    behind (the history's max is the last step's), and the share of elements past E4M3's
    max (before the cast, which hides them) is what a float64 simulation of the same
    history gives, step by step."""
    model = _mlp("fp8_delayed", history=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(model, opt, run_dir=tmp_path, loss_fn=_loss, log_every=1,
                            rollback={"enabled": False})  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(16, 64, generator=g) * 1.3**k for k in range(8)]
    hist, scale, want = [0.0] * 4, 1.0, []
    for x in guard.batches(data):
        sat = float(((x.double() * scale).abs() > E4M3_SAT).double().mean())
        want.append((sat, float(x.abs().max() * scale / E4M3_MAX)))
        hist = [*hist[1:], float(x.abs().max())]
        scale = E4M3_MAX / max(hist)
        loss = _loss(model, x)
        loss.backward()
        if guard.before_step(loss).apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()
    seen = _logged(tmp_path)
    for step, (sat, ratio) in enumerate(want, 1):
        assert math.isclose(seen[step]["q_sat/0.x"], sat, abs_tol=1e-7), (step, seen[step])
        assert math.isclose(seen[step]["q_ratio/0.x"], ratio, rel_tol=1e-5), step
    # step 1 casts with scale 1 (far below the max); from step 2 the scale is one step
    # behind a tensor 1.3x larger: past 464 / 448 = 1.036, elements saturate
    assert want[0][0] == 0 and all(s > 0 for s, _ in want[1:])


@pytest.mark.parametrize(("rounding", "clipped"), [("floor", True), ("rceil", False)])
def test_mx_floor_clips_a_block_whose_amax_mantissa_is_1_9_and_rceil_keeps_it(
    rounding, clipped, tmp_path
):
    model = _mlp("mxfp8", scale_rounding=rounding)
    with torch.no_grad():
        model[0].weight.mul_(0.01)
        model[0].weight[0, 0] = 1.9 * 2.0**-3  # block 0's amax: mantissa 1.9
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = stabilize.Guard(model, opt, run_dir=tmp_path, loss_fn=_loss, log_every=1,
                            rollback={"enabled": False})  # fmt: skip
    for x in guard.batches([torch.randn(16, 64)]):
        loss = _loss(model, x)
        loss.backward()
        guard.before_step(loss)
    guard.close()
    share = _logged(tmp_path)[1]["q_clip/0.w"]
    assert (share > 0) == clipped, share
    if clipped:  # one block of 64 * 64 / 32 = 128
        assert share == pytest.approx(1 / 128)


def test_nvfp4_trains_and_its_series_are_logged(tmp_path):
    model = _mlp("nvfp4")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = stabilize.Guard(model, opt, run_dir=tmp_path, loss_fn=_loss, log_every=1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g)
    losses = []
    for batch in guard.batches([x] * 20):
        loss = _loss(model, batch)
        loss.backward()
        if guard.before_step(loss).apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    guard.close()
    assert losses[-1] < 0.5 * losses[0]  # it learns through 4-bit GEMMs
    seen = _logged(tmp_path)[20]
    assert 0 < seen["q_sqnr/0.x"] < 30  # E2M1: about 2 bits of mantissa


def test_importing_torchao_through_transformers_prints_nothing_after_import_stabilize():
    """With the fp8 extra installed, transformers imports torchao, whose import logs a line
    per CUDA extension a CPU machine lacks and a deprecation for two enums: after
    ``import stabilize`` those lines are gone (and only those)."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    code = "import stabilize, torchao, transformers.trainer; print('done')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stderr
    assert "Failed to load" not in r.stderr and "Enum subclass" not in r.stderr, r.stderr
