"""The 8- and 4-bit formats and their scales against hand-computed values (stabilize.quant).

Every expected number here is worked out by hand in the comment beside it, from the formats'
specifications (OCP 8-bit FP, OCP MX v1.0, NVIDIA's NVFP4) and Transformer Engine's delayed
scaling rule; none is read back from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from stabilize.quant import scaling
from stabilize.quant.formats import (
    E2M1,
    E4M3,
    E5M2,
    cast,
    e2m1_values,
    e8m0_decode,
    e8m0_encode,
    elem_format,
    overflows,
)
from stabilize.quant.headroom import headroom
from stabilize.quant.quantize import Scheme, quantize, scheme_for
from stabilize.validate import ConfigError


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---- element formats ---------------------------------------------------------------------


def test_e2m1_has_fifteen_values_and_rounds_ties_to_even():
    assert e2m1_values() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    grid = torch.tensor(e2m1_values())
    assert torch.equal(cast(grid, E2M1), grid)  # every value is its own rounding
    # midpoints go to the even mantissa: 0.25->0 (0 is even), 0.75->1, 1.25->1, 1.75->2,
    # 2.5->2, 3.5->4, 5->4; above 6 saturates to 6 (no inf in E2M1)
    ties = t(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.9, 1e9, math.inf)
    want = t(0, 1, 1, 2, 2, 4, 4, 6, 6, 6)
    assert torch.equal(cast(ties, E2M1), want)
    assert torch.equal(cast(-ties, E2M1), -want)
    # off the midpoints: the nearest value (2.4 -> 2, 2.6 -> 3, 4.9 -> 4, 5.1 -> 6)
    assert torch.equal(cast(t(0.26, 0.74, 2.4, 2.6, 4.9, 5.1), E2M1), t(0.5, 0.5, 2, 3, 4, 6))
    assert (E2M1.max, E2M1.emax, E2M1.overflow_from, E2M1.overflow_tie_up) == (6, 2, 7, True)


def test_e4m3_max_448_saturating_cast_and_saturation_counted_before_it():
    assert E4M3.max == 448 == torch.finfo(torch.float8_e4m3fn).max
    # E4M3 448 = 1.110b * 2^8; its ulp there is 2^(8-3) = 32, so half an ulp above is 464,
    # and 464 is a tie between 448 (mantissa 110, even) and 480: it rounds down
    assert (E4M3.emax, E4M3.overflow_from, E4M3.overflow_tie_up) == (8, 464, False)
    # torch's own CPU cast (no clamp first) saturates: 480, 1e4 and inf all become 448
    raw = cast(t(480, 1e4, math.inf, -1e4), E4M3, saturate=False)
    assert torch.equal(raw, t(448, 448, 448, -448))
    mask = overflows(t(448, 463, 464, 464.5, 480, 1e4, math.inf), E4M3)
    assert mask.tolist() == [False, False, False, True, True, True, True]
    # 2 of 8 values past 464 under scale 1: the cast shows eight ordinary values <= 448,
    # the count taken before it says 2/8 saturated, and the one group is clipped
    x = t(1, 2, 100, 448, 460, 480, 1e4, -3)
    q = quantize(x, Scheme("delayed"), scale=torch.tensor(1.0))
    assert q.dequantize().abs().max() == 448
    h = headroom(x, Scheme("delayed"), scale=torch.tensor(1.0))
    assert h.saturated.item() == 2 / 8
    assert h.clipped_blocks.item() == 1.0
    assert h.amax_ratio.item() == pytest.approx(1e4 / 448)


def test_e5m2_max_57344_and_inf_from_61440():
    assert E5M2.max == 57344 == torch.finfo(torch.float8_e5m2).max
    # 57344 = 1.11b * 2^15, ulp 2^13 = 8192: half an ulp above is 61440, a tie between
    # 57344 (mantissa 11, odd) and 2^16 (even): it rounds up, out of range, to inf
    assert (E5M2.emax, E5M2.overflow_from, E5M2.overflow_tie_up) == (15, 61440, True)
    raw = cast(t(57344, 61439, 61440, 1e6), E5M2, saturate=False)
    assert raw.tolist() == [57344, 57344, math.inf, math.inf]
    assert cast(t(61440, 1e6), E5M2).tolist() == [57344, 57344]  # the recipes saturate
    assert overflows(t(61439, 61440), E5M2).tolist() == [False, True]


def test_smallest_values_and_underflow_boundaries():
    # E4M3's smallest subnormal is 2^-9; 2^-10 is the tie with 0 and goes to 0 (even)
    assert (E4M3.min_normal, E4M3.min_subnormal) == (2.0**-6, 2.0**-9)
    assert cast(t(2.0**-9, 2.0**-10, 2.0**-10 * 1.01), E4M3).tolist() == [2.0**-9, 0, 2.0**-9]
    assert (E5M2.min_normal, E5M2.min_subnormal) == (2.0**-14, 2.0**-16)
    assert cast(t(2.0**-16, 2.0**-17), E5M2).tolist() == [2.0**-16, 0]


def test_e8m0_powers_of_two_from_2_to_minus_127_to_2_to_127_and_nan_255():
    codes = e8m0_encode(torch.tensor([-127, -1, 0, 1, 127, -300, 300]))
    assert codes.tolist() == [0, 126, 127, 128, 254, 0, 254]  # code = exponent + 127, clamped
    assert e8m0_encode(torch.tensor([float("nan")])).tolist() == [255]
    scales = e8m0_decode(torch.tensor([0, 126, 127, 254, 255], dtype=torch.uint8))
    assert scales[:4].tolist() == [2.0**-127, 0.5, 1.0, 2.0**127]
    assert math.isnan(scales[4])
    # torch's own E8M0 dtype reads the same codes as the same numbers
    ref = torch.tensor([0, 126, 127, 254], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(ref.float(), scales[:4])


# ---- MX block scales: FLOOR clips what RCEIL keeps ----------------------------------------


@pytest.mark.parametrize("k", [-20, -3, 0, 7, 20])
def test_mx_floor_clips_amax_1_9_times_2_to_k_where_rceil_keeps_it(k):
    block = torch.full((1, 32), 2.0**k * 0.25)
    block[0, 0] = 1.9 * 2.0**k
    # FLOOR: scale 2^(floor(log2(1.9 * 2^k)) - 8) = 2^(k-8); 1.9 * 2^k / 2^(k-8) = 486.4,
    # past 464: saturated to 448, back as 448 * 2^(k-8) = 1.75 * 2^k (k=7: 243.2 -> 224)
    floor = quantize(block, Scheme("mx", scale_rounding="floor"))
    assert floor.dequantize()[0, 0].item() == 1.75 * 2.0**k
    assert torch.exp2(scaling.mx_exponent(floor.group_amax, E4M3, "floor")).item() == 2.0 ** (k - 8)
    # RCEIL: 2^ceil(log2(1.9 * 2^k / 448)) = 2^(k + ceil(-7.88)) = 2^(k-7); 243.2 lies in
    # [128, 256) where E4M3's ulp is 16: it rounds to 240, back as 240 * 2^(k-7)
    rceil = quantize(block, Scheme("mx", scale_rounding="rceil"))
    assert rceil.dequantize()[0, 0].item() == 1.875 * 2.0**k
    hf = headroom(block, Scheme("mx", scale_rounding="floor"))
    hr = headroom(block, Scheme("mx", scale_rounding="rceil"))
    assert (hf.saturated.item(), hf.clipped_blocks.item()) == (1 / 32, 1.0)
    assert hf.amax_ratio.item() == pytest.approx(486.4 / 448)
    assert (hr.saturated.item(), hr.clipped_blocks.item()) == (0.0, 0.0)
    assert hr.amax_ratio.item() == pytest.approx(243.2 / 448)


def test_mx_floor_mantissa_between_1_75_and_1_8125_rounds_to_max_anyway():
    # mantissa 1.8: 1.8 * 256 = 460.8 > 448 (amax_ratio > 1) but < 464, so it rounds to 448
    # as it would with more exponent: not saturated. 1.8125 * 256 = 464 is the tie (down).
    for m, saturated in ((1.75, 0), (1.8, 0), (1.8125, 0), (1.82, 1 / 32)):
        block = torch.full((1, 32), 0.1)
        block[0, 0] = m * 2.0**7
        h = headroom(block, Scheme("mx", scale_rounding="floor"))
        assert h.saturated.item() == saturated, m
        assert h.amax_ratio.item() == pytest.approx(m * 256 / 448)


# ---- NVFP4: fp32 tensor scale x E4M3 block scale ------------------------------------------


def test_nvfp4_two_level_scale_by_hand():
    x = torch.zeros(1, 32)
    x[0, :3] = t(12, 5, -1)  # block 0: amax 12, the tensor's
    x[0, 16:18] = t(3, 1.1)  # block 1: amax 3
    ts = scaling.nvfp4_tensor_scale(x.abs().amax())
    assert ts.item() == pytest.approx(12 / 2688)  # amax / (448 * 6)
    q = quantize(x, Scheme("nvfp4", "e2m1"))
    # block scales: 12 / 6 / (12 / 2688) = 448 and 3 / 6 / (12 / 2688) = 112, both exact in
    # E4M3 (112 = 1.75 * 2^6); decode scales 448 * 12/2688 = 2 and 112 * 12/2688 = 0.5
    assert (q.scale / ts).flatten().tolist() == pytest.approx([448, 112])
    assert q.scale.flatten().tolist() == pytest.approx([2.0, 0.5])
    # 12/2 = 6 -> 6 -> 12; 5/2 = 2.5 -> 2 (tie, even) -> 4; -1/2 = -0.5 -> -1
    # 3/0.5 = 6 -> 3; 1.1/0.5 = 2.2 -> 2 -> 1
    out = q.dequantize()[0]
    assert out[:3].tolist() == pytest.approx([12, 4, -1])
    assert out[16:18].tolist() == pytest.approx([3, 1])


def test_nvfp4_block_scale_rounding_never_saturates():
    # a block scale rounded down by E4M3 (at most 1/16) lifts a block's amax to <= 6.375 < 7
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 256)
    h = headroom(x, Scheme("nvfp4", "e2m1"))
    assert h.saturated.item() == 0 and h.clipped_blocks.item() == 0
    assert 1.0 < h.amax_ratio.item() <= 1.0625


# ---- delayed scaling ----------------------------------------------------------------------


def test_delayed_scale_over_a_hand_made_history():
    hist = t(1, 4, 2, 8, 3)  # oldest -> newest
    d = scaling.delayed_scale
    assert d(hist, E4M3, algo="max").item() == 448 / 8  # 56
    assert d(hist, E4M3, algo="most_recent").item() == pytest.approx(448 / 3)
    assert d(hist, E4M3, margin=2, algo="max").item() == 448 / (8 * 4)  # 14
    assert d(hist, E4M3, margin=2, algo="most_recent").item() == pytest.approx(448 / 12)
    assert d(hist, E5M2, algo="max").item() == 57344 / 8  # 7168


def test_delayed_state_scales_from_the_past_and_saturates_a_growing_tensor():
    state = scaling.DelayedScaling(E4M3, history=4)
    assert state.scale.item() == 1.0  # no history yet: scale 1, as Transformer Engine starts
    scales = [state.update(torch.tensor(a)).item() for a in (2.0, 4.0, 8.0, 1.0, 1.0, 1.0)]
    # history (4 slots, zeros at first) after each update and its max: [0,0,0,2] 2,
    # [0,0,2,4] 4, [0,2,4,8] 8, [2,4,8,1] 8, [4,8,1,1] 8, [8,1,1,1] 8 -> 448 / max
    assert scales == [224, 112, 56, 56, 56, 56]
    state.update(torch.tensor(1.0))  # history [1, 1, 1, 1]
    assert state.scale.item() == 448
    # a tensor doubling each step: its scale is taken from last step's amax, so this step's
    # amax lands at 2 * 448 = 896 > 464 and is clipped; a margin of 1 holds it exactly
    for margin, clipped in ((0, 1.0), (1, 0.0)):
        st = scaling.DelayedScaling(E4M3, history=16, margin=margin)
        st.update(torch.tensor(8.0))
        x = t(16, 3, -2)
        h = headroom(x, Scheme("delayed"), scale=st.scale)
        assert h.clipped_blocks.item() == clipped
        assert h.amax_ratio.item() == 16 * 448 / 8 / 2**margin / 448


def test_most_recent_forgets_a_spike_that_max_remembers():
    for algo, ratio in (("max", 1.0), ("most_recent", 8.0)):
        st = scaling.DelayedScaling(E4M3, history=2, algo=algo)
        st.update(torch.tensor(8.0))
        st.update(torch.tensor(1.0))  # history [8, 1]: max says 8, most_recent says 1
        h = headroom(t(8.0, 1.0), Scheme("delayed"), scale=st.scale)
        assert h.amax_ratio.item() == ratio


# ---- degenerate amax: never a NaN scale, never an infinite one ----------------------------


CURRENT_SCHEMES = (
    Scheme("tensor"),
    Scheme("rowwise", pow2=True),
    Scheme("mx"),
    Scheme("mx", scale_rounding="floor"),
    Scheme("nvfp4", "e2m1"),
)


def test_zero_and_tiny_amax_give_finite_scales_and_no_nan():
    zero, tiny = torch.tensor(0.0), torch.tensor(1e-45)  # 1e-45: fp32's smallest subnormal
    for a in (zero, tiny):
        assert torch.isfinite(scaling.current_scale(a, E4M3))
        assert torch.isfinite(scaling.nvfp4_tensor_scale(a))
        assert torch.isfinite(torch.exp2(scaling.mx_exponent(a.reshape(1), E4M3, "floor")))
    # current scaling clamps amax at 1e-12: 448 / 1e-12
    assert scaling.current_scale(zero, E4M3).item() == pytest.approx(4.48e14)
    # delayed: a zero history keeps the previous scale; a tiny one would give 448 / 1e-45 =
    # inf in fp32 and is replaced by fp32's largest value
    st = scaling.DelayedScaling(E4M3, history=4)
    assert st.update(zero).item() == 1.0
    assert st.update(tiny).item() == torch.finfo(torch.float32).max
    for x in (torch.zeros(4, 32), torch.full((4, 32), 1e-40)):
        for scheme in CURRENT_SCHEMES:
            out = quantize(x, scheme).dequantize()
            assert not torch.isnan(out).any(), scheme
            h = headroom(x, scheme)
            assert not any(math.isnan(v) for v in h.stack().tolist()), scheme
    # an all-zero tensor is exact: SQNR +inf, nothing saturated, nothing underflowed
    h = headroom(torch.zeros(2, 32), Scheme("nvfp4", "e2m1"))
    assert (h.sqnr_db.item(), h.saturated.item(), h.underflow.item()) == (math.inf, 0, 0)
    # tensorwise with amax 1e-40: the scale is capped at 448 / 1e-12, every value scales to
    # 4.48e-26 and underflows to 0: the underflow share is 1, and says so
    assert headroom(torch.full((4, 32), 1e-40), Scheme("tensor")).underflow.item() == 1.0


# ---- bad input: one line naming the key, the value and what is allowed --------------------


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: Scheme("fp4"), "quant.kind='fp4'"),
        (lambda: Scheme("nvfp4", "e4m3"), "quant.elem='e4m3'"),
        (lambda: Scheme("tensor", "e2m1"), "quant.elem='e2m1'"),
        (lambda: Scheme("mx", scale_rounding="even"), "quant.scale_rounding='even'"),
        (lambda: elem_format("e3m4"), "quant.elem='e3m4'"),
        (lambda: scheme_for("int8", "input"), "quant='int8'"),
        (lambda: scheme_for("mxfp8", "bias"), "quant.role='bias'"),
        (lambda: scaling.DelayedScaling(history=0), "quant.history=0"),
        (lambda: scaling.DelayedScaling(margin=-1), "quant.margin=-1"),
        (lambda: scaling.DelayedScaling(algo="mean"), "quant.amax_algo='mean'"),
    ],
)
def test_bad_settings_fail_on_one_line(make, key):
    with pytest.raises(ConfigError) as err:
        make()
    msg = str(err.value)
    assert msg.startswith(key) and "allowed" in msg and "\n" not in msg


def test_a_last_dim_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.ones(4, 48), Scheme("mx"))


def test_recipes_pick_torchao_and_transformer_engine_formats_per_role():
    assert scheme_for("none", "input") is None
    assert scheme_for("fp8_tensor", "input").elem == "e4m3"
    assert scheme_for("fp8_tensor", "grad_output").elem == "e5m2"
    assert scheme_for("fp8_rowwise", "grad_output") == Scheme("rowwise", "e4m3", pow2=True)
    assert scheme_for("fp8_delayed", "grad_output") == Scheme("delayed", "e5m2")
    assert scheme_for("mxfp8", "weight", scale_rounding="floor").scale_rounding == "floor"
    assert scheme_for("nvfp4", "grad_output").block == 16
