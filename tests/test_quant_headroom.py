"""Headroom counts against an independent float64 computation, and against torchao itself.

The float64 reference below is written from the formats' definitions (a generic round-to-
nearest-even to a float with ``mbits`` mantissa bits and a smallest exponent ``emin``), not
from stabilize.quant: the two share no code. torchao's own quantizers are compared bit for bit
where they run on CPU; those tests skip cleanly when torchao is not installed.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from stabilize.quant import ao
from stabilize.quant.headroom import Headroom, headroom, stack_all
from stabilize.quant.quantize import Scheme, quantize
from stabilize.validate import ConfigError

# (mantissa bits, smallest normal exponent, max, overflow threshold, tie at threshold goes up)
F64 = {
    "e4m3": (3, -6, 448.0, 464.0, False),
    "e5m2": (2, -14, 57344.0, 61440.0, True),
    "e2m1": (1, 0, 6.0, 7.0, True),
}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}


def rne64(v: torch.Tensor, elem: str) -> torch.Tensor:
    """Round float64 ``v`` to ``elem`` (saturating), by the textbook rule."""
    mbits, emin, vmax, _, _ = F64[elem]
    mag = v.abs().clamp(max=vmax)
    e = torch.floor(torch.log2(mag)).clamp(min=emin)  # log2(0) = -inf -> emin
    ulp = torch.exp2(e - mbits)
    return torch.copysign((torch.round(mag / ulp) * ulp).clamp(max=vmax), v)


def past_edge(mag: torch.Tensor, elem: str) -> torch.Tensor:
    _, _, _, edge, up = F64[elem]
    return mag >= edge if up else mag > edge


def reference(x: torch.Tensor, scheme: Scheme, scale: float | None = None) -> dict[str, float]:
    """The six counts in float64; the scales follow each recipe's written rule."""
    x = x.double()
    elem, vmax = scheme.elem, F64[scheme.elem][2]
    if scheme.kind in ("tensor", "delayed"):
        g = x.reshape(1, -1)
    else:
        g = x.reshape(-1, scheme.block or x.shape[-1])
    a = g.abs().amax(dim=-1, keepdim=True)
    if scheme.kind == "delayed":
        enc = torch.full_like(a, scale)
    elif scheme.kind in ("tensor", "rowwise"):
        enc = (vmax / a.clamp(min=1e-12)).float().double()  # the scale is stored in fp32
        if scheme.pow2:
            enc = torch.exp2(torch.floor(torch.log2(enc)))
    elif scheme.kind == "mx":
        if scheme.scale_rounding == "floor":
            e = torch.floor(torch.log2(a)) - EMAX[elem]
        else:
            e = torch.ceil(torch.log2(a / vmax))
        enc = 1 / torch.exp2(e.clamp(-127, 127))
    else:  # nvfp4
        ts = (a.max() / 2688).float().double()
        bs = rne64((a / 6 / ts).clamp(2.0**-6, 448), "e4m3")
        enc = 1 / (ts * bs)
    scaled = g * enc
    sat = past_edge(scaled.abs(), elem)
    x_hat = rne64(scaled, elem) / enc
    noise = torch.linalg.vector_norm(g - x_hat)
    return {
        "amax": a.max().item(),
        "amax_ratio": scaled.abs().max().item() / vmax,
        "saturated": sat.double().mean().item(),
        "underflow": ((g != 0) & (x_hat == 0)).double().mean().item(),
        "clipped_blocks": sat.any(dim=-1).double().mean().item(),
        "sqnr_db": 20 * math.log10(torch.linalg.vector_norm(g).item() / noise.item()),
    }


def wide_tensor(seed: int) -> torch.Tensor:
    """Magnitudes over nine decades, so every scheme both underflows and (some) saturates."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 256, generator=gen)
    x = x * torch.exp2(torch.empty(48, 256).uniform_(-22, 8, generator=gen))
    x[0, :7] = 0.0  # exact zeros are neither underflow nor signal
    return x


SCHEMES = [
    Scheme("tensor", "e4m3"),
    Scheme("tensor", "e5m2"),
    Scheme("rowwise", "e4m3", pow2=True),
    Scheme("mx", "e4m3", scale_rounding="floor"),
    Scheme("mx", "e4m3", scale_rounding="rceil"),
    Scheme("mx", "e2m1", scale_rounding="floor"),
    Scheme("nvfp4", "e2m1"),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.kind}-{s.elem}-{s.scale_rounding}")
def test_counts_match_an_independent_float64_computation(scheme):
    for seed in range(3):
        x = wide_tensor(seed)
        got = Headroom.unstack(headroom(x, scheme).stack())
        want = reference(x, scheme)
        for name in ("amax", "saturated", "underflow", "clipped_blocks"):
            assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-12), name
        assert got["amax_ratio"] == pytest.approx(want["amax_ratio"], rel=1e-6)
        assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-4)
        assert got["underflow"] > 0  # the data was built to exercise it


def test_delayed_counts_step_by_step_match_float64():
    # a tensor growing 1.3x a step under a 4-step history: each step's counts against float64
    from stabilize.quant.scaling import DelayedScaling

    state = DelayedScaling(history=4, margin=0)
    base = wide_tensor(7)
    saturated_steps = 0
    for step in range(8):
        x = base * 1.3**step
        got = Headroom.unstack(headroom(x, Scheme("delayed"), scale=state.scale).stack())
        want = reference(x, Scheme("delayed"), scale=state.scale.item())
        for name in ("saturated", "underflow", "clipped_blocks", "amax_ratio"):
            assert got[name] == pytest.approx(want[name], rel=1e-6, abs=1e-12), (step, name)
        saturated_steps += got["saturated"] > 0
        state.update(x.abs().amax())
    assert saturated_steps >= 6  # growth outruns a history-based scale nearly every step


def test_counts_are_device_tensors_gathered_once():
    x = wide_tensor(1)
    h = headroom(x, Scheme("mx"))
    assert all(getattr(h, n).shape == () and getattr(h, n).device == x.device for n in h.names())
    assert h.stack().shape == (len(Headroom.names()),)
    with pytest.raises(ValueError, match="do not match the fields"):
        Headroom.unstack([1.0, 2.0])
    names, table = stack_all({"fc.input": h, "fc.weight": headroom(x, Scheme("tensor"))})
    assert names == ["fc.input", "fc.weight"] and table.shape == (2, len(Headroom.names()))
    assert Headroom.unstack(table[0]) == Headroom.unstack(h.stack())
    assert stack_all({})[1].shape == (0, len(Headroom.names()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counts_take_no_host_sync_on_cuda():
    from stabilize.quant.scaling import DelayedScaling

    x = wide_tensor(2).cuda()
    state = DelayedScaling(history=16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for scheme in SCHEMES:
            headroom(x, scheme).stack()
        headroom(x, Scheme("delayed"), scale=state.scale).stack()
        state.update(x.abs().amax())
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- torchao: absent by default, quiet when present, and our arithmetic is its arithmetic --


def test_import_stabilize_and_quant_load_no_torchao_and_its_import_is_quiet():
    code = (
        "import sys, stabilize, stabilize.quant.headroom, stabilize.quant.ao\n"
        "assert 'torchao' not in sys.modules, 'torchao imported eagerly'\n"
        "from stabilize.quant import ao\n"
        "if ao.torchao_version():\n"
        "    ao.quiet_import('torchao.prototype.mx_formats.mx_tensor')\n"
        "    ao.quiet_import('torchao.float8')\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok" and r.stderr == ""


def test_missing_or_old_torchao_is_one_line(monkeypatch):
    for found, says in ((None, "not installed"), ("0.17.1", "found 0.17.1")):
        monkeypatch.setattr(ao, "torchao_version", lambda found=found: found)
        with pytest.raises(ConfigError) as err:
            ao.quiet_import(value="mxfp8")
        msg = str(err.value)
        assert msg.startswith("quant='mxfp8' needs torchao>=0.18") and says in msg
        assert "allowed: pip install 'stabilize[fp8]'" in msg and "\n" not in msg


@pytest.mark.parametrize("seed", [0, 1])
def test_our_quantizers_match_torchao_bit_for_bit(seed):
    pytest.importorskip("torchao")
    x = wide_tensor(seed) * 1e4  # some blocks past fp32's usual range of activations
    e4, e5, f4 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2
    pairs = [
        (Scheme("tensor", "e4m3"), ao.fp8_roundtrip(x, e4)),
        (Scheme("tensor", "e5m2"), ao.fp8_roundtrip(x, e5)),
        (Scheme("rowwise", "e4m3", pow2=True), ao.fp8_roundtrip(x, e4, rowwise=True, pow2=True)),
        (Scheme("nvfp4", "e2m1"), ao.nvfp4_roundtrip(x)),
    ]
    for rounding in ("floor", "rceil"):
        for elem, dtype in (("e4m3", e4), ("e5m2", e5), ("e2m1", f4)):
            mx = ao.mx_roundtrip(x, dtype, rounding)
            pairs.append((Scheme("mx", elem, scale_rounding=rounding), mx))
    for scheme, theirs in pairs:
        assert torch.equal(quantize(x, scheme).dequantize(), theirs), scheme


def test_torchao_mx_floor_gives_224_and_rceil_240_for_243_2():
    pytest.importorskip("torchao")
    block = torch.full((1, 32), 0.5)
    block[0, 0] = 1.9 * 2**7  # 243.2
    assert ao.mx_roundtrip(block, torch.float8_e4m3fn, "floor")[0, 0].item() == 224
    assert ao.mx_roundtrip(block, torch.float8_e4m3fn, "rceil")[0, 0].item() == 240


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_trains_a_tiny_mlp_on_cpu(recipe):
    pytest.importorskip("torchao")
    model = _mlp()
    converted = ao.convert_float8(model, recipe, layers=["0", "2"], emulate=True)
    assert converted == ["0", "2"]
    assert all(type(model[i]).__name__ == "Float8Linear" for i in (0, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(32, 64)
    y = 0.5 * x
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.2 * losses[0]


def test_layer_globs_exclude_the_head_and_refuse_a_glob_matching_nothing():
    model = torch.nn.Module()
    model.block = _mlp()
    model.lm_head = torch.nn.Linear(64, 10)
    assert ao.select_linears(model) == ["block.0", "block.2"]
    assert ao.select_linears(model, ["block.2", "lm_head"], exclude=()) == ["block.2", "lm_head"]
    with pytest.raises(ConfigError, match=r"^quant.layers='blok\.\*' matches no nn.Linear"):
        ao.select_linears(model, ["blok.*"])
