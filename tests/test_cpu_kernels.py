"""The fused CPU RMSNorm/ScaleNorm kernel against independent references (float64 formulas
written here, F.rms_norm), and the rules that decide when it runs or falls back.

The kernel is built once per session (~30-40 s cold, then cached on disk; conftest sets
STABILIZE_KERNEL_WAIT, so runs wait for it); without a C++ compiler or ninja the numeric tests
skip and the fallback tests still run."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stabilize import cpu_kernels
from stabilize.norms import NormConfig, auto_backend, build_norm, has_cpp_compiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# rel. error of a 16-bit result: about one rounding of the output (and of gamma's product)
TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
GTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernel():
    if not cpu_kernels.available():
        pytest.skip(f"fused CPU kernel unavailable: {cpu_kernels.unavailable_reason()}")
    return cpu_kernels.load()


def ref(kind, x, w, eps):
    """float64: x / sqrt(mean x^2 + eps) * w (ScaleNorm: sum instead of mean, scalar w)."""
    x = x.double()
    stat = (x**2).mean(-1, keepdim=True) if kind == "rmsnorm" else (x**2).sum(-1, keepdim=True)
    y = x / torch.sqrt(stat + eps)
    return y if w is None else y * w.double()


def fused(kind, d, eps=1e-5, affine=True, seed=0):
    norm = build_norm(
        d, NormConfig(type=kind, backend="fused", reduction_dtype="fp32", eps=eps, affine=affine)
    )
    if affine:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            norm.weight.copy_(norm.weight + 0.5 * torch.randn(norm.weight.shape, generator=g))
    return norm


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_both(norm, x, gy, eps):
    """Fused fwd+bwd, and the float64 reference fwd+bwd on the same values."""
    x = x.detach().requires_grad_()
    y = norm(x)
    y.backward(gy)
    x64 = x.detach().double().requires_grad_()
    w64 = None if norm.weight is None else norm.weight.detach().double().requires_grad_()
    r = ref(norm.kind, x64, w64, eps)
    r.backward(gy.double())
    return y, x.grad, r, x64.grad, w64


# ---- numerics -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["rmsnorm", "scalenorm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fwd_bwd_match_float64_including_dgamma(kernel, kind, dtype):
    torch.manual_seed(1)
    norm = fused(kind, 96).to(dtype)
    x = (3 * torch.randn(70, 96) + 0.7).to(dtype)  # 70 rows: three dgamma blocks
    gy = torch.randn(70, 96).to(dtype)
    y, gx, r, gx64, w64 = run_both(norm, x, gy, 1e-5)
    assert y.dtype == gx.dtype == norm.weight.grad.dtype == dtype
    assert rel_err(y, r) < TOL[dtype]
    assert rel_err(gx, gx64) < GTOL[dtype]
    assert rel_err(norm.weight.grad, w64.grad) < GTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_agrees_with_the_explicit_backend(kernel, dtype):
    """Same rounding order as explicit: (x * r).to(act) * gamma.to(act)."""
    torch.manual_seed(2)
    x = (2 * torch.randn(33, 128)).to(dtype)
    f, e = fused("rmsnorm", 128), build_norm(128, NormConfig(type="rmsnorm", backend="explicit"))
    e.load_state_dict(f.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(f(x), e(x))


def test_matches_f_rms_norm_fp32(kernel):
    torch.manual_seed(3)
    norm, x = fused("rmsnorm", 64), torch.randn(9, 64)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))


def test_non_contiguous_and_3d_inputs_match_the_contiguous_2d_result(kernel):
    torch.manual_seed(4)
    norm = fused("rmsnorm", 32)
    base = torch.randn(32, 2, 5, 3)  # x[..., 0] is [32, 2, 5]: last dim strided
    x3 = base[..., 0].permute(1, 2, 0)  # [B=2, T=5, D=32], non-contiguous
    assert not x3.is_contiguous()
    gy = torch.randn(2, 5, 32)
    y, gx, r, gx64, _ = run_both(norm, x3, gy, 1e-5)
    dw = norm.weight.grad.clone()
    norm.weight.grad = None
    y2, gx2, *_ = run_both(norm, x3.contiguous().view(10, 32), gy.view(10, 32), 1e-5)
    assert y.shape == gx.shape == (2, 5, 32)
    torch.testing.assert_close(y.view(10, 32), y2, rtol=0, atol=0)
    torch.testing.assert_close(gx.reshape(10, 32), gx2, rtol=0, atol=0)
    torch.testing.assert_close(dw, norm.weight.grad, rtol=0, atol=0)
    assert rel_err(y, r) < 1e-6 and rel_err(gx, gx64) < 1e-5


def test_row_of_zeros_gives_zeros_and_the_eps_gradient(kernel):
    norm = fused("rmsnorm", 16, eps=1e-5)
    x = torch.randn(3, 16)
    x[1] = 0.0
    gy = torch.randn(3, 16)
    y, gx, r, gx64, w64 = run_both(norm, x, gy, 1e-5)
    assert torch.all(y[1] == 0)
    # d/dx of x / sqrt(eps) at x = 0: gy * w / sqrt(eps), by hand
    expect = gy[1] * norm.weight.detach() / math.sqrt(1e-5)
    torch.testing.assert_close(gx[1], expect, rtol=1e-5, atol=0)
    assert rel_err(gx, gx64) < 1e-5


def test_eps_is_added_to_the_mean_square(kernel):
    x = 0.01 * torch.randn(4, 64)  # mean square ~1e-4: eps = 1e-2 dominates it
    with torch.no_grad():
        small, big = fused("rmsnorm", 64, eps=1e-6)(x), fused("rmsnorm", 64, eps=1e-2)(x)
    w = fused("rmsnorm", 64).weight.detach()
    assert rel_err(small, ref("rmsnorm", x, w, 1e-6)) < 1e-6
    assert rel_err(big, ref("rmsnorm", x, w, 1e-2)) < 1e-6
    assert big.abs().max() < 0.2 * small.abs().max()


def test_no_affine_and_scalenorm_scalar_gain(kernel):
    torch.manual_seed(5)
    x, gy = torch.randn(6, 40), torch.randn(6, 40)
    y, gx, r, gx64, _ = run_both(fused("rmsnorm", 40, affine=False), x, gy, 1e-5)
    assert rel_err(y, r) < 1e-6 and rel_err(gx, gx64) < 1e-5
    sn = fused("scalenorm", 40)
    assert sn.weight.dim() == 0
    y, gx, r, gx64, w64 = run_both(sn, x, gy, 1e-5)
    assert rel_err(y, r) < 1e-6 and rel_err(gx, gx64) < 1e-5
    assert rel_err(sn.weight.grad, w64.grad) < 1e-5


def test_under_fp16_autocast_output_is_fp16_and_grads_stay_fp32(kernel):
    torch.manual_seed(6)
    norm = fused("rmsnorm", 64)
    x = (3 * torch.randn(8, 64)).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        assert norm.resolve_backend(x) == "fused"
        y = norm(x)
        y.float().backward(torch.ones(8, 64))
    assert y.dtype == torch.float16
    assert x.grad.dtype == norm.weight.grad.dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    r = ref("rmsnorm", x64, w64, 1e-5)
    r.sum().backward()
    assert rel_err(y, r) < 2e-3
    assert rel_err(x.grad, x64.grad) < 5e-3
    assert rel_err(norm.weight.grad, w64.grad) < 2e-3


def test_result_does_not_depend_on_the_thread_count(kernel):
    """dgamma is summed per fixed block of rows, not per thread: bit-identical results."""
    torch.manual_seed(7)
    norm, x, gy = fused("rmsnorm", 256), torch.randn(300, 256), torch.randn(300, 256)
    before, out = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            norm.weight.grad = None
            y, gx, *_ = run_both(norm, x, gy, 1e-5)
            out.append((y, gx, norm.weight.grad))
    finally:
        torch.set_num_threads(before)
    for other in out[1:]:
        for a, b in zip(out[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_builds_once(kernel):
    assert cpu_kernels.load() is kernel


# ---- when it runs, and the fallback ----------------------------------------------------------
def test_missing_tools_are_named(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    assert cpu_kernels.missing_tools(path="") == ["C++ compiler (c++)", "ninja"]
    if shutil.which("c++"):
        assert "C++ compiler (c++)" not in cpu_kernels.missing_tools()


def test_a_failed_build_falls_back_with_its_reason(tmp_path, monkeypatch, caplog):
    """A real compiler run that fails (an unknown flag): None and a warning, no exception."""
    if cpu_kernels.missing_tools():
        pytest.skip(f"no build tools: {cpu_kernels.missing_tools()}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_reason", None)  # restored afterwards
    with caplog.at_level(logging.WARNING, logger="stabilize.cpu_kernels"):
        mod = cpu_kernels.build(name="stabilize_bad_flag", cflags=["--no-such-flag-xyz"])
    assert mod is None
    assert "build failed" in cpu_kernels.unavailable_reason()
    assert "falling back" in caplog.text


def test_auto_falls_back_to_compiled_when_the_kernel_is_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_kernels, "ready", lambda start=True: None)
    monkeypatch.setattr(cpu_kernels, "_reason", "ninja not found")
    expect = "compiled" if has_cpp_compiler() else "explicit"
    assert auto_backend("rmsnorm", "cpu") == expect
    norm = build_norm(8, NormConfig(type="rmsnorm", backend="fused"))
    with pytest.raises(RuntimeError, match="could not be built \\(ninja not found\\)"):
        norm.resolve_backend(torch.randn(2, 8))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """cpu_kernels as in a new process with nothing built (its build dir under tmp_path), and
    runs that do not wait for the build (conftest's STABILIZE_KERNEL_WAIT removed)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("STABILIZE_KERNEL_WAIT", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in [("_loaded", []), ("_builder", None), ("_announced", False)]:
        monkeypatch.setattr(cpu_kernels, name, value)
    monkeypatch.setattr(cpu_kernels, "_reason", None)
    monkeypatch.setattr(cpu_kernels, "_next_poll", {True: 0.0, False: 0.0})
    monkeypatch.setattr(cpu_kernels, "_POLL_S", 0.0)
    return tmp_path


class FakeBuild:
    """The background build process: running until ``rc`` is set."""

    def __init__(self):
        self.rc, self.started = None, 0

    def spawn(self):
        self.started += 1
        return self

    def poll(self):
        return self.rc


def test_a_run_never_waits_for_the_build_and_says_so_once(fresh, monkeypatch, capsys):
    if cpu_kernels.missing_tools():
        pytest.skip(f"no build tools: {cpu_kernels.missing_tools()}")
    proc = FakeBuild()
    monkeypatch.setattr(cpu_kernels, "_spawn", proc.spawn)
    x, out = torch.randn(10), torch.zeros(1)
    cpu_kernels.absmax_into(x, out, 0)  # the monitors' statistic never starts a build
    assert proc.started == 0 and out.item() == x.abs().max().item()
    assert cpu_kernels.ready() is None and cpu_kernels.ready() is None  # no wait, one build
    assert auto_backend("rmsnorm", "cpu") == ("compiled" if has_cpp_compiler() else "explicit")
    assert proc.started == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "in the background" in err[0] and cpu_kernels.AHEAD in err[0]
    assert cpu_kernels.unavailable_reason() is None  # still building: not a failure
    (fresh / cpu_kernels._NAME).mkdir()
    (fresh / cpu_kernels._NAME / "build.log").write_text("...\nc++: error: boom\n")
    proc.rc = 1
    assert cpu_kernels.ready() is None and not cpu_kernels.available()  # once, for good
    assert "background build failed (exit 1: c++: error: boom" in cpu_kernels.unavailable_reason()
    assert proc.started == 1


def test_a_built_kernel_is_picked_up_without_a_build(kernel, monkeypatch):
    """Built on disk (by the `kernel` fixture, or ahead with `python -m stabilize.cpu_kernels
    build`): ready() and absmax_into load it."""
    monkeypatch.delenv("STABILIZE_KERNEL_WAIT", raising=False)
    monkeypatch.setattr(cpu_kernels, "_loaded", [])
    monkeypatch.setattr(cpu_kernels, "_next_poll", {True: 0.0, False: 0.0})
    monkeypatch.setattr(cpu_kernels, "_spawn", lambda: pytest.fail("no build: it is built"))
    assert cpu_kernels.is_built()
    out = torch.zeros(1)
    cpu_kernels.absmax_into(torch.tensor([1.0, -3.0]), out, 0)
    assert out.item() == 3.0 and cpu_kernels._loaded[0].__file__ == kernel.__file__
    assert cpu_kernels.ready().__file__ == kernel.__file__


@pytest.mark.slow
def test_the_background_build_finishes_and_the_run_switches_to_it(tmp_path):
    """A real build in a fresh extensions dir: ready() returns at once, then the kernel."""
    if cpu_kernels.missing_tools():
        pytest.skip(f"no build tools: {cpu_kernels.missing_tools()}")
    probe = (
        "import time; from stabilize import cpu_kernels as k\n"
        "t0 = time.monotonic(); assert k.ready() is None; print('first', time.monotonic() - t0)\n"
        "while k.ready() is None and k.unavailable_reason() is None: time.sleep(1)\n"
        "print('built', time.monotonic() - t0, k.ready().__file__)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("STABILIZE_KERNEL_WAIT", None)
    r = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    first, built = r.stdout.splitlines()
    assert float(first.split()[1]) < 5 and "in the background" in r.stderr
    assert Path(built.split()[2]).is_relative_to(tmp_path)


def test_auto_picks_fused_only_where_it_can_run(kernel):
    x = torch.randn(2, 8)
    for kind in ("rmsnorm", "scalenorm"):
        assert build_norm(8, NormConfig(type=kind)).resolve_backend(x) == "fused"
        # fp64 input with an "input" reduction: not the kernel's dtype -> compiled as before
        norm = build_norm(8, NormConfig(type=kind, reduction_dtype="input"))
        assert norm.resolve_backend(x.double()) == "compiled"
    assert build_norm(8, NormConfig(type="layernorm")).resolve_backend(x) == "torch"


def test_fused_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="cannot honour norm.reduction_dtype='fp16'"):
        NormConfig(type="rmsnorm", backend="fused", reduction_dtype="fp16")
    with pytest.raises(ValueError, match="RMSNorm and ScaleNorm only"):
        NormConfig(type="layernorm", backend="fused")
    norm = build_norm(8, NormConfig(type="rmsnorm", backend="fused", reduction_dtype="input"))
    with pytest.raises(ValueError, match="reduction_dtype='input' for torch.bfloat16"):
        norm.resolve_backend(torch.randn(2, 8, dtype=torch.bfloat16))  # a 16-bit reduction
    norm = build_norm(8, NormConfig(type="rmsnorm", backend="fused"))
    with pytest.raises(ValueError, match="cannot run a meta"):  # any non-CPU device
        norm.resolve_backend(torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match=r"'fused'\]"):  # the allowed list names it
        NormConfig(backend="triton")


@pytest.mark.parametrize("dim", [100, 2048])  # 100: the vector loop's tail too
def test_fp16_activations_match_explicit_forward_and_backward_with_gamma(kernel, dim):
    """fp32 input under fp16 autocast (the residual stream entering a norm): the fp16 rounding
    the fused loops do in registers must give what explicit's .to(fp16) steps give."""
    torch.manual_seed(4)
    f = fused("rmsnorm", dim)
    e = build_norm(dim, NormConfig(type="rmsnorm", backend="explicit"))
    with torch.no_grad():
        f.weight.copy_(1 + 0.3 * torch.randn(dim))
    e.load_state_dict(f.state_dict())
    x = (3 * torch.randn(37, dim)).requires_grad_()
    gy = torch.randn(37, dim).half()
    out = []
    for norm in (f, e):
        x.grad = None
        norm.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            y = norm(x)
        y.backward(gy)
        out.append((y.detach(), x.grad.clone(), norm.weight.grad.clone()))
    (yf, gxf, dwf), (ye, gxe, dwe) = out
    assert yf.dtype == ye.dtype == torch.float16
    torch.testing.assert_close(yf, ye, rtol=1e-3, atol=1e-3)
    # explicit's backward runs in fp16 autograd steps, fused in fp32: agree to fp16 precision
    torch.testing.assert_close(gxf, gxe, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dwf, dwe, rtol=2e-2, atol=2e-2)


# ---- absmax_into: the monitors' one-pass |x| max -------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 65536, 3 * 65536 + 17])  # around the 64K-element chunks
def test_absmax_into_matches_float64_and_folds_with_max(kernel, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 300).to(dtype)
    x[n // 3] = -7e4 if dtype != torch.float16 else -6e4  # the largest magnitude, negative
    expect = x.double().abs().max().item()
    out = torch.tensor([5.0, -1.0, 1e6])
    cpu_kernels.absmax_into(x, out, 1)
    cpu_kernels.absmax_into(x, out, 2)  # an existing larger value stays
    assert out.tolist() == [5.0, expect, 1e6]
    # the same through the torch fallback (what CUDA and torch.compile's tracing run)
    fb, strided = torch.tensor([-1.0]), torch.stack([x, x], 1)[:, 0]
    assert n == 1 or not strided.is_contiguous()
    cpu_kernels.absmax_into(strided, fb, 0)
    assert fb.item() == expect
    # thread-count independent (fixed chunks)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.zeros(1)
        cpu_kernels.absmax_into(x, one, 0)
    finally:
        torch.set_num_threads(before)
    assert one.item() == expect


@pytest.mark.parametrize("dtype", DTYPES)
def test_absmax_into_propagates_nan_over_inf_over_finite(kernel, dtype):
    x = torch.randn(100_000).to(dtype)
    for k, v in [(5, float("-inf")), (99_999, float("inf"))]:
        y = x.clone()
        y[k] = v
        out = torch.zeros(1)
        cpu_kernels.absmax_into(y, out, 0)
        assert out.item() == math.inf
        y[70_000] = float("nan")  # in another chunk than the inf
        cpu_kernels.absmax_into(y, out, 0)
        assert math.isnan(out.item())
        cpu_kernels.absmax_into(x, out, 0)  # NaN is sticky across micro-batches
        assert math.isnan(out.item())


def test_absmax_into_falls_back_to_torch_ops_without_the_kernel(monkeypatch):
    """No compiler, or a non-contiguous/float64/CUDA input: torch ops, same answer."""
    x = torch.randn(64, 48, dtype=torch.float64) * 10
    out = torch.tensor([0.0, 3.0])
    cpu_kernels.absmax_into(x.t(), out, 0)  # float64, non-contiguous: not the kernel's
    assert out[0].item() == pytest.approx(x.abs().max().item(), rel=1e-7)
    monkeypatch.setattr(cpu_kernels, "_loaded", [None])  # as if the build had failed
    y = torch.randn(1000)
    y[10] = float("nan")
    cpu_kernels.absmax_into(y, out, 1)
    assert math.isnan(out[1].item())


# ---- head_norm_max: the attention bound's per-head row norm --------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_max_matches_float64_on_a_strided_view(kernel, dtype):
    """q as the model makes it: a [B, T, 3C] projection split, viewed [B, H, T, d] (strided)."""
    g = torch.Generator().manual_seed(7)
    b, t, h, d = 16, 37, 5, 24  # 80 (b, h) tasks: more than one grain (36), so 2 threads split
    qkv = (torch.randn(b, t, 3 * h * d, generator=g) * 40).to(dtype)
    q = qkv[..., : h * d].view(b, t, h, d).transpose(1, 2)
    assert not q.is_contiguous()
    q[9, 3, 11, 5] = -3000.0  # one large row in head 3 of sequence 9
    expect = q.double().square().sum(-1).sqrt().amax(dim=(0, 2))
    got = cpu_kernels.head_norm_max(q)
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got.double(), expect, rtol=1e-6, atol=0)
    assert got.argmax().item() == 3
    before = torch.get_num_threads()
    try:  # (b, h) tasks reduced in a fixed order: the same bits on one thread and on two
        torch.set_num_threads(2)
        two = cpu_kernels.head_norm_max(q)
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.head_norm_max(q), two)
    finally:
        torch.set_num_threads(before)
    q[0, 1, 0, 0] = float("nan")  # NaN wins in its head, the others are untouched
    nan = cpu_kernels.head_norm_max(q)
    assert math.isnan(nan[1].item()) and torch.equal(nan[[0, 2, 3, 4]], got[[0, 2, 3, 4]])


def test_head_norm_max_falls_back_to_torch_ops_without_the_kernel(monkeypatch):
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)  # float64: not the kernel's
    expect = x.square().sum(-1).sqrt().amax(dim=(0, 2))
    torch.testing.assert_close(cpu_kernels.head_norm_max(x).double(), expect, rtol=1e-6, atol=0)
    monkeypatch.setattr(cpu_kernels, "_loaded", [None])  # as if the build had failed
    y = x.float()
    torch.testing.assert_close(cpu_kernels.head_norm_max(y).double(), expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fallbacks_read_16_bit_inputs_in_place_and_match_float64(monkeypatch, dtype):
    """What CUDA runs: ``aminmax`` (one pass) for |x| max, and the q / k norm accumulated in
    fp32 from the 16-bit tensor itself (``vector_norm``'s ``dtype``), on a strided view,
    against float64; NaN still wins in its head."""
    monkeypatch.setattr(cpu_kernels, "_loaded", [None])  # as if the build had failed
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(4, 13, 3 * 3 * 16, generator=g) * 40).to(dtype)
    q = qkv[..., : 3 * 16].view(4, 13, 3, 16).transpose(1, 2)  # [B, H, T, d], strided
    q[2, 1, 5, 7] = -900.0
    expect = q.double().square().sum(-1).sqrt().amax(dim=(0, 2))
    got = cpu_kernels.head_norm_max(q)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expect, rtol=1e-6, atol=0)
    # the bits of the old path, which made an fp32 copy first (on CPU: not measured on CUDA)
    assert torch.equal(got, torch.linalg.vector_norm(q.float(), dim=-1).amax(dim=(0, 2)))
    out = torch.tensor([0.0])
    cpu_kernels.absmax_into(q, out, 0)
    assert out.item() == q.double().abs().max().item() == 900.0
    q[0, 2, 0, 0] = float("nan")
    nan = cpu_kernels.head_norm_max(q)
    assert math.isnan(nan[2].item()) and not nan[:2].isnan().any()


# ---- adamw_sums: the per-block update ratio's sums in one pass ---------------------------
def _adamw_sums64(p, g, state, group, coef):
    """The three sums by hand in float64: torch's AdamW update (decoupled decay, bias-
    corrected moments) for the gradient coef * g, before it is applied."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    b1, b2 = group["betas"]
    t = float(state["step"]) + 1 if state else 1.0
    p, g = p.double(), g.double() * coef
    m = state["exp_avg"].double() if state else torch.zeros_like(p)
    v = state["exp_avg_sq"].double() if state else torch.zeros_like(p)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    vhat = v / (1 - b2**t)
    change = lr * wd * p + lr / (1 - b1**t) * m / (vhat.sqrt() + eps)
    ratio = torch.where(vhat > 0, g * g / vhat, torch.zeros_like(g))
    return [change.square().sum().item(), p.square().sum().item(), ratio.sum().item()]


@pytest.mark.parametrize("with_state", [False, True])
def test_adamw_sums_match_a_float64_adamw_by_hand(kernel, with_state):
    gen = torch.Generator().manual_seed(3)
    n = 70_001  # several chunks and a ragged tail
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    g[:100] = 0.0  # v_hat 0 on the first step: ratio 0 there
    group = {"lr": 3e-4, "weight_decay": 0.1, "eps": 1e-8, "betas": (0.9, 0.95)}
    state = {}
    if with_state:
        state = {"step": torch.tensor(6.0), "exp_avg": torch.randn(n, generator=gen) * 1e-3,
                 "exp_avg_sq": torch.rand(n, generator=gen) * 1e-6}  # fmt: skip
    got = cpu_kernels.adamw_sums(p, g, state, group, 0.37)
    want = _adamw_sums64(p, g, state, group, 0.37)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_adamw_sums_leave_what_they_cannot_read_to_torch(kernel):
    group = {"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, "betas": (0.9, 0.999)}
    p = torch.randn(8, 4)
    assert cpu_kernels.adamw_sums(p.bfloat16(), p.bfloat16(), {}, group, 1.0) is None
    assert cpu_kernels.adamw_sums(p.t(), p.t(), {}, group, 1.0) is None  # not contiguous
    assert cpu_kernels.adamw_sums(p.double(), p.double(), {}, group, 1.0) is None


def test_block_update_ratios_are_the_same_through_the_kernel_and_torch(kernel):
    """The probe's per-block gradient norm, update ratio and g^2 / v_hat: the kernel's path
    (keep=False) against the torch ops' (keep=True, which the curvature needs), a real
    AdamW three steps in, clipping on."""
    from stabilize.model import GPT, GPTConfig
    from stabilize.stability.param_stats import block_grad_update_norms, param_groups_by_block
    from stabilize.stability.view import view_of

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=64, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 64, (2, 16))
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        if _ < 3:
            opt.step()
    groups, index = param_groups_by_block(model, view_of(model))
    idx = torch.tensor(index)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    fast = block_grad_update_norms(groups, idx, opt, norm, 0.5 * norm.item())
    slow = block_grad_update_norms(groups, idx, opt, norm, 0.5 * norm.item(), keep=True)
    for a, b in zip(fast[:4], slow[:4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
