"""Norm numerics against independent references: float64 formulas written here, PyTorch's
own kernels, and hand-computed fp16 limits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stabilize.norms import (
    NORM_TYPES,
    NormConfig,
    auto_backend,
    build_norm,
    has_cpp_compiler,
    set_reduction_dtype,
)

CPU_BACKENDS = ["explicit", "torch", "auto"] + (["compiled"] if has_cpp_compiler() else [])


# ---- independent float64 references (no code shared with stabilize.norms) ----------------
# One per registered norm type, written from its definition. A type registered without one
# here fails every test that needs it (``ref_norm``), never falls back to another's.
def _layernorm64(x, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps)


def _rmsnorm64(x, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps)


def _scalenorm64(x, eps):  # g * x / ||x|| with eps under the root; g is a scalar
    return x / torch.sqrt((x**2).sum(-1, keepdim=True) + eps)


# type -> (its reference, the dimensions of its gamma: 1 for [D], 0 for a scalar gain)
REFERENCES = {
    "layernorm": (_layernorm64, 1),
    "rmsnorm": (_rmsnorm64, 1),
    "scalenorm": (_scalenorm64, 0),
}


def ref_norm(kind, x, w, b, eps):
    if kind not in REFERENCES:
        pytest.fail(f"norm type {kind!r} has no float64 reference: add one to REFERENCES")
    reference, gamma_dims = REFERENCES[kind]
    y = reference(x.double(), eps)
    if w is not None:
        assert w.dim() == gamma_dims, (kind, tuple(w.shape))
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def test_every_registered_norm_type_has_its_own_reference():
    assert set(NORM_TYPES) <= set(REFERENCES), set(NORM_TYPES) - set(REFERENCES)


def make(kind, d, backend="explicit", reduction="fp32", eps=1e-5, seed=0, **kw):
    norm = build_norm(
        d, NormConfig(type=kind, backend=backend, reduction_dtype=reduction, eps=eps, **kw)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial affine parameters, so gamma/beta mistakes show
        if norm.weight is not None:
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
        if norm.bias is not None:
            norm.bias.copy_(0.5 * torch.randn(norm.bias.shape, generator=g))
    return norm


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- forward and backward against float64 -------------------------------------------------
@pytest.mark.parametrize("kind", NORM_TYPES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matches_float64_reference_fwd_bwd(kind, backend):
    torch.manual_seed(1)
    norm = make(kind, 48, backend=backend)
    x = (3 * torch.randn(5, 7, 48) + 0.7).requires_grad_()
    gy = torch.randn(5, 7, 48)
    y = norm(x)
    y.backward(gy)

    x64 = x.detach().double().requires_grad_()
    w64 = None if norm.weight is None else norm.weight.detach().double().requires_grad_()
    b64 = None if norm.bias is None else norm.bias.detach().double().requires_grad_()
    ref = ref_norm(kind, x64, w64, b64, 1e-5)
    ref.backward(gy.double())

    assert y.dtype == torch.float32
    assert rel_err(y, ref) < 1e-6
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert rel_err(norm.weight.grad, w64.grad) < 1e-5
    if b64 is not None:
        assert rel_err(norm.bias.grad, b64.grad) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layernorm_and_rmsnorm_match_pytorch_kernels(backend):
    torch.manual_seed(2)
    x = torch.randn(6, 64)
    ln = make("layernorm", 64, backend=backend)
    rms = make("rmsnorm", 64, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(ln(x), F.layer_norm(x, (64,), ln.weight, ln.bias, 1e-5))
        torch.testing.assert_close(rms(x), F.rms_norm(x, (64,), rms.weight, 1e-5))


@pytest.mark.parametrize("kind", NORM_TYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_explicit_float64(kind, affine):
    torch.manual_seed(3)
    norm = make(kind, 6, reduction="input", affine=affine).double()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    params = [p for p in (norm.weight, norm.bias) if p is not None]

    def f(x, *ps):
        return norm(x)

    assert torch.autograd.gradcheck(f, (x, *params))


# ---- invariants ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("scale", [0.01, 100.0])
def test_rmsnorm_unit_gamma_maps_every_token_to_norm_sqrt_d(backend, scale):
    d = 256
    norm = build_norm(d, NormConfig(type="rmsnorm", backend=backend, eps=1e-8))
    x = scale * torch.randn(10, d)
    with torch.no_grad():
        norms = norm(x).double().norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(d)), rtol=1e-4, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layernorm_invariant_to_shift_and_positive_scale(backend):
    # exact only as eps -> 0: at eps 1e-5 the x0.5 input (variance 1/4) moves an output of 5
    # by ~1e-4 (5 x 1e-5 x (2 - 1/2)), the tolerance itself; the draw made it fail or pass
    norm = make("layernorm", 128, backend=backend, eps=1e-12)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y = norm(x)
        torch.testing.assert_close(norm(x + 3.0), y, atol=1e-4, rtol=0)
        torch.testing.assert_close(norm(7.0 * x), y, atol=1e-4, rtol=0)
        torch.testing.assert_close(norm(0.5 * x - 2.0), y, atol=1e-4, rtol=0)


# ---- the fp16 overflow, measured ----------------------------------------------------------
def _row_with_300(d=64):
    torch.manual_seed(4)
    x = torch.randn(4, d)
    x[1, 5] = 300.0  # 300^2 = 90000 > 65504: the square alone overflows in fp16
    return x


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_fp16_reduction_overflow_zeroes_the_row_and_its_gradient(kind):
    x = _row_with_300().half().requires_grad_()
    norm = make(kind, 64, reduction="fp16")
    y = norm(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    assert y.dtype == torch.float16
    # The overflowed token: output all zeros (plus beta for LayerNorm), a zero gradient, no NaN.
    expect_row = torch.zeros(64) if norm.bias is None else norm.bias.detach()
    torch.testing.assert_close(y[1].float(), expect_row.half().float())
    assert torch.all(x.grad[1] == 0)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    # The other tokens are untouched by the overflow.
    ref = ref_norm(kind, x.detach()[[0, 2, 3]], norm.weight, norm.bias, 1e-5)
    assert rel_err(y[[0, 2, 3]], ref) < 3e-3


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_fp32_reduction_rescues_the_same_fp16_input(kind):
    x = _row_with_300().half().requires_grad_()
    norm = make(kind, 64, reduction="fp32")
    y = norm(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    x64 = x.detach().double().requires_grad_()
    w = None if norm.weight is None else norm.weight.detach()
    b = None if norm.bias is None else norm.bias.detach()
    ref = ref_norm(kind, x64, w, b, 1e-5)
    ref.backward(gy.double())
    assert y.dtype == torch.float16
    assert rel_err(y, ref) < 2e-3  # fp16 output rounding only
    assert rel_err(x.grad[1], x64.grad[1]) < 5e-3
    assert x.grad[1].abs().sum() > 0


def test_reduction_knob_works_under_autocast():
    """Autocast would run sum/pow in fp32 behind our back; the knob must still bite."""
    x = _row_with_300()  # the residual stream stays fp32 under autocast
    outs = {}
    for red in ("fp16", "fp32"):
        norm = make("rmsnorm", 64, reduction=red)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            y = norm(xr)
            assert y.dtype == torch.float16  # the activation dtype, gamma cast to it
            y.float().backward(torch.ones_like(y, dtype=torch.float32))
        outs[red] = (y.detach().float(), xr.grad)
    y16, g16 = outs["fp16"]
    y32, g32 = outs["fp32"]
    assert torch.all(y16[1] == 0) and torch.all(g16[1] == 0)
    ref = ref_norm("rmsnorm", x, make("rmsnorm", 64).weight.detach(), None, 1e-5)
    assert rel_err(y32, ref) < 2e-3
    assert g32[1].abs().sum() > 0
    torch.testing.assert_close(y16[[0, 2, 3]], y32[[0, 2, 3]], atol=2e-2, rtol=1e-2)


def test_fp16_sum_overflows_below_256_at_the_rms_line():
    """Summing D squares in fp16 overflows once RMS > 255.94 / sqrt(D) (5.66 at D = 2048)."""
    d = 2048
    line = math.sqrt(65504) / math.sqrt(d)  # computed by hand here, not by the package
    norm = build_norm(d, NormConfig(type="rmsnorm", backend="explicit", reduction_dtype="fp16"))
    with torch.no_grad():
        below = norm(torch.full((1, d), 0.97 * line, dtype=torch.float16))
        above = norm(torch.full((1, d), 1.03 * line, dtype=torch.float16))
    assert 1.03 * line < 256  # no single square overflows
    torch.testing.assert_close(below.float(), torch.ones(1, d), atol=2e-3, rtol=0)
    assert torch.all(above == 0)


def test_pytorch_rms_norm_upcasts_internally():
    """Why the torch backend cannot honour fp16: F.rms_norm stays finite on the same input."""
    x = _row_with_300().half()
    y = F.rms_norm(x, (64,), None, 1e-5)
    assert torch.isfinite(y).all() and y[1].abs().max() > 1
    with pytest.raises(ValueError, match="norm.backend='torch' cannot honour"):
        NormConfig(type="rmsnorm", backend="torch", reduction_dtype="fp16")


# ---- precision of each reduction dtype ------------------------------------------------------
@pytest.mark.parametrize("kind", NORM_TYPES)
def test_bf16_reduction_error_is_order_2_pow_minus_8_and_fp32_below_1e6(kind):
    torch.manual_seed(5)
    x = 3 * torch.randn(64, 512) + 1.0
    ref = ref_norm(kind, x, None, None, 1e-5)
    errs = {}
    for red in ("bf16", "fp32"):
        norm = build_norm(
            512, NormConfig(type=kind, backend="explicit", reduction_dtype=red, affine=False)
        )
        with torch.no_grad():
            errs[red] = rel_err(norm(x), ref)
    assert 2**-12 < errs["bf16"] < 2**-6, errs
    assert errs["fp32"] < 1e-6, errs


# ---- backends: choice, honesty, switching ----------------------------------------------------
def test_auto_picks_a_backend_that_honours_the_reduction():
    x16 = torch.randn(2, 32, dtype=torch.float16)
    for kind in NORM_TYPES:
        assert (
            build_norm(32, NormConfig(type=kind, reduction_dtype="fp16")).resolve_backend(x16)
            == "explicit"
        )
        # "input" on a 16-bit tensor is a 16-bit reduction, which no fused kernel does
        assert (
            build_norm(32, NormConfig(type=kind, reduction_dtype="input")).resolve_backend(x16)
            == "explicit"
        )
        assert build_norm(32, NormConfig(type=kind)).resolve_backend(x16) == auto_backend(
            kind, "cpu"
        )
    assert auto_backend("layernorm", "cpu") == "torch"
    assert auto_backend("rmsnorm", "cuda") == "torch"


def test_fused_backend_refuses_a_16bit_input_reduction_at_run_time():
    norm = build_norm(32, NormConfig(type="layernorm", backend="torch", reduction_dtype="input"))
    norm(torch.randn(2, 32))  # fp32 input: "input" is fp32, fine
    with pytest.raises(ValueError, match=r"reduction_dtype='input' for torch.bfloat16"):
        norm(torch.randn(2, 32, dtype=torch.bfloat16))


def test_set_reduction_dtype_switches_a_live_model_in_place():
    model = torch.nn.Sequential(
        make("rmsnorm", 64, reduction="fp16"), make("layernorm", 64, reduction="fp16")
    )
    x = _row_with_300().half()
    with torch.no_grad():
        assert torch.all(model[0](x)[1] == 0)
        assert set_reduction_dtype(model, "fp32") == 2
        assert torch.isfinite(model(x)).all() and model[0](x)[1].abs().max() > 1
    with pytest.raises(ValueError, match="norm.reduction_dtype='fp8'"):
        set_reduction_dtype(model, "fp8")


def test_apex_backend_without_apex_says_how_to_get_it():
    try:
        import apex.normalization  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="NGC"):
            build_norm(64, NormConfig(backend="apex"))
    else:  # pragma: no cover - only inside NGC containers
        pytest.skip("apex is installed: covered by the CUDA test")


# ---- invalid settings ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        (dict(type="batchnorm"), "norm.type", "'batchnorm'"),
        (dict(eps=0.0), "norm.eps", "0.0"),
        (dict(eps=-1e-5), "norm.eps", "-1e-05"),
        (dict(reduction_dtype="fp8"), "norm.reduction_dtype", "'fp8'"),
        (dict(backend="triton"), "norm.backend", "'triton'"),
        (dict(placement="middle"), "norm.placement", "'middle'"),
    ],
)
def test_invalid_settings_name_field_value_and_allowed(kwargs, field, value):
    with pytest.raises(ValueError) as e:
        NormConfig(**kwargs)
    msg = str(e.value)
    assert f"{field}={value}" in msg
    if field != "norm.eps":
        assert "allowed: [" in msg
    else:
        assert "positive" in msg


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "torch", "explicit", "compiled"])
def test_cuda_reduction_knob_under_autocast(backend):  # pragma: no cover - GPU only
    x = _row_with_300().cuda()
    norm16 = make("rmsnorm", 64, backend="explicit", reduction="fp16").cuda()
    norm32 = make("rmsnorm", 64, backend=backend, reduction="fp32").cuda()
    with torch.autocast("cuda", dtype=torch.float16), torch.no_grad():
        assert torch.all(norm16(x)[1] == 0)
        y = norm32(x)
    ref = ref_norm("rmsnorm", x.cpu(), norm32.weight.detach().cpu(), None, 1e-5)
    assert rel_err(y.cpu(), ref) < 2e-3


def test_fp16_reduction_backward_overflows_for_small_activations_and_eps_guards_it():
    """The *backward* of an fp16 reduction goes inf/NaN with a perfectly finite forward for
    rows of small RMS (here 0.01, typical at init; the cut is measured in the next test). A
    larger eps bounds ms from below: eps = 1e-3 keeps rsqrt(ms)^3 <= 31623 (hand-computed)."""
    torch.manual_seed(6)
    x = 0.01 * torch.randn(4, 64)
    results = {}
    for red, eps in (("fp16", 1e-5), ("fp16", 1e-3), ("fp32", 1e-5)):
        norm = build_norm(
            64, NormConfig(type="rmsnorm", backend="explicit", reduction_dtype=red, eps=eps)
        )
        xh = x.half().requires_grad_()
        y = norm(xh)
        y.float().backward(torch.randn(4, 64))
        results[(red, eps)] = (torch.isfinite(y).all().item(), torch.isfinite(xh.grad).all().item())
    assert results[("fp16", 1e-5)] == (True, False)  # finite forward, broken backward
    assert results[("fp16", 1e-3)] == (True, True)
    assert results[("fp32", 1e-5)] == (True, True)


def test_fp16_backward_cut_is_where_rsqrt_cubed_overflows_in_fp16():
    """Issue 11: the backward's cut is not where d rsqrt(ms)/d ms = -ms^-1.5 / 2 passes 65504
    (RMS 0.0197; at RMS 0.03 that derivative is 1.85e4), but where autograd's rsqrt backward
    forms result^3 *in fp16*: rsqrt(ms) rounded to fp16 >= 40.34375, whose cube is inf. With
    eps 1e-5 that is RMS 0.02459 (0.0248 without eps). Rows swept across the cut, their RMS
    read in float64; the prediction comes from fp16 arithmetic on a grid of r, not the norm."""
    d, n = 64, 400
    base = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    base /= base.square().mean(-1, keepdim=True).sqrt()  # every row RMS 1
    x = (base * torch.linspace(0.020, 0.030, n, dtype=torch.float64)[:, None]).half()
    rms = x.double().square().mean(-1).sqrt()
    norm = build_norm(
        d, NormConfig(type="rmsnorm", backend="explicit", reduction_dtype="fp16", eps=1e-5)
    )
    xh = x.clone().requires_grad_()
    y = norm(xh)
    y.float().backward(torch.randn(n, d, generator=torch.Generator().manual_seed(1)))
    ok = torch.isfinite(xh.grad).all(-1)
    assert torch.isfinite(y).all()  # the forward is fine on every row
    worst_bad, best_ok = rms[~ok].max().item(), rms[ok].min().item()
    assert worst_bad < best_ok  # one clean cut
    r = torch.arange(38, 44, 1 / 32, dtype=torch.float64).half()  # fp16 values of rsqrt(ms)
    cube_ok = torch.isfinite(r * r * r)
    first_inf, last_ok = r[~cube_ok].min().item(), r[cube_ok].max().item()
    assert (last_ok, first_inf) == (40.3125, 40.34375)
    ms_cut = 1 / ((last_ok + first_inf) / 2) ** 2  # rsqrt(ms) rounds up to 40.34375 below it
    predicted = math.sqrt(ms_cut - 1e-5)
    assert worst_bad <= predicted <= best_ok
    assert predicted == pytest.approx(0.02459, abs=5e-5)
    assert math.sqrt(ms_cut) == pytest.approx(0.0248, abs=5e-5)  # the cut without eps
    assert (2 * 65504) ** (-1 / 3) < 0.0197  # the old claim's cut: far below the real one


@pytest.mark.parametrize("d, heads, broken", [(128, 4, True), (2048, 16, False)])
def test_init_rows_bunch_up_above_the_backward_cut_at_full_width(d, heads, broken):
    """Issue 11: "expect the full-scale baseline to stall at step 1" was wrong. The first
    norm's input at init, wte[token] + wpe[position] (GPT-2 init, std 0.02 each), has a row
    RMS near 0.028 whose spread shrinks as 1/sqrt(D): at D = 128 some rows fall below the
    fp16 backward's cut (0.0246, previous test) and their gradient is inf/NaN; at D = 2048
    none does (min ~0.0265 here), so the init-time failure need not happen at full width.
    Every (byte, position) row is read, in float64 and through the real fp16 backward. The
    upstream gradient is small (1e-2 per element): the product with a row's summed gradient
    can still overflow under a large loss scale, which the GradScaler's ordinary back-offs
    absorb (issue 11's D = 2048 baseline trained after 5 of them); rsqrt^3 is inf whatever
    the scale."""
    from stabilize.model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(d_model=d, n_head=heads, n_layer=1, mlp_ratio=1, block_size=32))
    with torch.no_grad():
        x = (m.wte.weight[:, None, :] + m.wpe.weight[None, :, :]).reshape(-1, d)  # [256*32, D]
    rms = x.double().square().mean(-1).sqrt()
    norm = build_norm(
        d, NormConfig(type="rmsnorm", backend="explicit", reduction_dtype="fp16", eps=1e-5)
    )
    xh = x.half().requires_grad_()
    (norm(xh).float().sum() * 1e-2).backward()
    bad = ~torch.isfinite(xh.grad).all(-1)
    assert bad.any().item() is broken
    assert (rms.min().item() < 0.0246) is broken
    if broken:
        assert rms[bad].max().item() < 0.0247  # exactly the rows below the cut
    else:
        assert 0.026 < rms.min().item() < 0.0275


def test_headroom_math_matches_hand_values():
    from stabilize.numerics import square_limit, sum_of_squares_rms_limit

    assert square_limit(torch.float16) == pytest.approx(255.9375, abs=1e-3)  # sqrt(65504)
    assert sum_of_squares_rms_limit(torch.float16, 2048) == pytest.approx(5.6554, abs=1e-4)
    with pytest.raises(ValueError, match="dim=0"):
        sum_of_squares_rms_limit(torch.float16, 0)
