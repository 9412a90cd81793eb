"""A fused CPU RMSNorm/ScaleNorm (fp32 statistics), built from C++ (``csrc/cpu_kernels.cpp``,
shipped in the wheel) with ``torch.utils.cpp_extension.load``; ``absmax_into``, the
monitors' one-pass |x| max; ``head_norm_max``, the attention bound's per-head row norm; and
``adamw_sums``, the per-block update ratio's sums in one pass.

Why: on CPU, ``F.rms_norm`` is unfused and inductor will not fuse RMSNorm's dgamma column
reduction into the dx row loop, so the ``compiled`` backend ran ~1.3x ``F.layer_norm`` in
fp32 (docs/norms.md). Here one pass per row does the forward (y and the row's rstd), and one
pass per row does the backward (dx, with dgamma accumulated into per-block partial rows that
are summed at the end), threaded with at::parallel_for so it follows torch.set_num_threads.

Numerics are the explicit backend's with reduction_dtype=fp32: x cast to fp32, sum of
squares, ``ss / D + eps`` (ScaleNorm: ``ss + eps``) and rsqrt in fp32; the normalized row is
rounded to the activation dtype, then multiplied by gamma cast to that dtype and rounded
again. The backward works in fp32 and rounds once, to x's dtype (dx) and to the activation
dtype (dgamma, which autograd then casts to the parameter's dtype, as for explicit).
16-bit *reductions* are not done here; float64 and CUDA tensors are not either (callers
check ``supports``). No double backward.

Building: ``python -m stabilize.cpu_kernels build`` builds it ahead of time and prints where
(torch's extensions dir, one directory per hash of source, flags, torch and Python). A run
never waits for it: ``ready()`` (the ``auto`` backend) loads a built kernel, else starts the
build in a background process, says so in one line, and the caller falls back until it is
done; ``absmax_into`` never starts a build. ``load()`` / ``available()`` (``backend=fused``,
the tests) build in the foreground. ``STABILIZE_KERNEL_WAIT=1`` makes ``ready()`` do the same
(the test suite sets it, so a run's backend does not change mid-run).

Portability: the build cache may be reused on another CPU, so no -march=native. The float
loops carry GCC/clang ``target_clones`` (an x86-64-v3 copy picked at load time, else
baseline SSE2), fp16 conversion uses F16C when the CPU has it. Any failure to build (no
compiler, no ninja, a compile error) makes ``load`` return None once, with the reason in
``unavailable_reason()``; the caller then falls back.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_kernels.cpp")
_CPP = Path(SOURCE).read_text(encoding="utf-8")
# The cache key: a changed source, flag, torch or Python builds under a new name.
_CFLAGS = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for is inline; torch's libgomp serves it
_LDFLAGS = ["-fopenmp"]
_KEY = repr((_CPP, _CFLAGS, _LDFLAGS, torch.__version__, sys.version))
_NAME = "stabilize_fused_rmsnorm_" + hashlib.sha1(_KEY.encode()).hexdigest()[:10]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STALE_LOCK_S = 600  # a build killed mid-way leaves torch's lock file: wait for it forever
BUILD_TIME = "~35 s on an idle 2-core machine, minutes under load"  # measured: 34 s
AHEAD = "python -m stabilize.cpu_kernels build"
_POLL_S = 2.0  # how often ready() looks for the background build's result

_lock = threading.Lock()
_reason: str | None = None
_announced = False
_builder: subprocess.Popen | None = None  # the background build started by ready()
_next_poll = {True: 0.0, False: 0.0}  # per ready(start=...): the next look at the disk


def _tool_dirs() -> list[str]:
    """Where a pip-installed ninja lives: the venv's bin (not on PATH when python is run by
    full path) and the ninja package's own bin dir."""
    dirs = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja  # type: ignore[import-not-found]

        dirs.append(ninja.BIN_DIR)
    return dirs


def missing_tools(path: str | None = None) -> list[str]:
    """The build tools not found on ``path`` (default: PATH plus the venv's bin)."""
    path = os.pathsep.join([*_tool_dirs(), os.environ.get("PATH", "")]) if path is None else path
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
    missing = [] if shutil.which(cxx, path=path) else [f"C++ compiler ({cxx})"]
    return missing + ([] if shutil.which("ninja", path=path) else ["ninja"])


def build_dir(name: str = _NAME) -> str:
    """Where the kernel is (or will be) built: under ``$TORCH_EXTENSIONS_DIR`` or torch's
    default extensions dir."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return os.path.join(root, name)


def is_built(name: str = _NAME) -> bool:
    """Is the kernel built on disk (its library there, no build holding the lock)?"""
    d = build_dir(name)
    return os.path.exists(os.path.join(d, name + ".so")) and not os.path.exists(
        os.path.join(d, "lock")
    )


def _announce(how: str) -> None:
    """The one visible line a run gets about the build (rank 0 of a node only)."""
    global _announced
    if not _announced and os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"stabilize: building the fused CPU RMSNorm kernel {how} (once, {BUILD_TIME}; "
            f"ahead of a run: {AHEAD})",
            file=sys.stderr,
            flush=True,
        )
    _announced = True


def build(name: str = _NAME, cflags: list[str] | None = None):
    """Compile and import the extension; None (and a logged warning) on any failure."""
    from torch.utils import cpp_extension

    if missing := missing_tools():
        return _fail(f"{' and '.join(missing)} not found (pip install ninja for ninja)")
    old_path = os.environ.get("PATH", "")
    try:
        os.environ["PATH"] = os.pathsep.join([*_tool_dirs(), old_path])
        out = build_dir(name)
        os.makedirs(out, exist_ok=True)
        lock = os.path.join(out, "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            log.warning("removing stale build lock %s", lock)
            os.remove(lock)
        if not os.path.exists(os.path.join(out, name + ".so")):
            _announce("now")
        # Built from a copy in the build dir, rewritten only when it differs: the ninja file
        # then names the same path wherever the package is installed (a wheel, a checkout),
        # so one cached build serves them all, as load_inline's main.cpp did.
        src = Path(out, "cpu_kernels.cpp")
        if not src.exists() or src.read_text(encoding="utf-8") != _CPP:
            src.write_text(_CPP, encoding="utf-8")
        return cpp_extension.load(
            name,
            sources=[str(src)],
            # copies: torch appends its libraries to the lists it is given, and a second load
            # in one process would then see other flags and rebuild as name_v1
            extra_cflags=list(_CFLAGS if cflags is None else cflags),
            extra_ldflags=list(_LDFLAGS),
            build_directory=out,
        )
    except Exception as e:  # a compile or link error must never stop training
        return _fail(f"build failed: {str(e).strip().splitlines()[-1] if str(e) else e!r}")
    finally:
        os.environ["PATH"] = old_path


def _fail(reason: str) -> None:
    global _reason
    _reason = reason
    log.warning("fused CPU RMSNorm kernel unavailable (%s); falling back", reason)
    return None


_loaded: list = []  # [module or None] once load() has run: later calls skip the lock


def load():
    """The built extension module, or None when it cannot be built (once per process).
    Builds in the foreground when it is not built yet (or waits for a build under way)."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded[:] = [build()]
    return _loaded[0]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    """Why ``load`` returned None (None while it has not been called or has succeeded)."""
    return _reason


def _spawn() -> subprocess.Popen:
    """``python -m stabilize.cpu_kernels build`` in its own session: it outlives this process
    (a killed build would leave torch's lock file behind) and logs to the build dir."""
    out = build_dir()
    os.makedirs(out, exist_ok=True)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [pkg_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))  # this very package
    with open(os.path.join(out, "build.log"), "w") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "stabilize.cpu_kernels", "build"],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def ready(start: bool = True):
    """The extension module if it can run now, else None; never waits for a build. Loads a
    kernel built on disk (a fraction of a second). Else, with ``start``, starts the build in
    the background (one line on stderr) and looks again every ``_POLL_S`` s; the caller runs
    its fallback meanwhile. ``start=False`` never builds (``absmax_into``)."""
    global _builder
    if _loaded:
        return _loaded[0]
    if start and os.environ.get("STABILIZE_KERNEL_WAIT") == "1":
        return load()
    now = time.monotonic()
    if now < _next_poll[start]:
        return None
    _next_poll[start] = now + _POLL_S
    if is_built():
        return load()
    if not start:
        return None
    with _lock:
        if _builder is None:
            if missing_tools():
                _loaded[:] = [build()]  # None at once, with the reason
                return None
            try:
                _builder = _spawn()
            except OSError as e:  # no process to build in: fall back, as for a failed build
                _loaded[:] = [_fail(f"could not start the build: {e}")]
                return None
            _announce("in the background; the torch fallback runs until it is done")
        elif (rc := _builder.poll()) not in (None, 0) and not _loaded:  # failed: no library
            logf = Path(build_dir(), "build.log")
            text = logf.read_text(errors="replace").strip() if logf.exists() else ""
            last = (text.splitlines() or ["no log"])[-1]
            _loaded[:] = [_fail(f"background build failed (exit {rc}: {last}; log {logf})")]
    return None


def supports(x: torch.Tensor, act: torch.dtype) -> bool:
    """Can the kernel run this input? CPU, fp32/bf16/fp16 input and activation dtype."""
    return x.device.type == "cpu" and x.dtype in DTYPES and act in DTYPES


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, mean, act):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        wf = x2.new_empty(0, dtype=torch.float32) if w is None else w.float().contiguous()
        y, rstd = load().rms_forward(x2, wf, eps, mean, _CODES[act])
        ctx.save_for_backward(x2, rstd, wf)
        ctx.info = (x.shape, None if w is None else w.dtype, mean)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x2, rstd, wf = ctx.saved_tensors
        shape, w_dtype, mean = ctx.info
        gy2 = gy.reshape(x2.shape).contiguous()
        dx, dw = load().rms_backward(gy2, x2, rstd, wf, mean)
        return dx.view(shape), None if w_dtype is None else dw.to(w_dtype), None, None, None


def absmax_into(x: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """``out[k] = max(out[k], |x| max)`` in place, NaN if either is NaN (else inf if x holds
    one): one read of x, no allocation, no host sync. The kernel on CPU (fp32/bf16/fp16,
    contiguous, eager, once built: this never builds it); elsewhere (CUDA, torch.compile's
    tracing, no compiler, not built yet) torch ops: ``max(max x, -min x)`` from one
    ``aminmax`` pass (one read of x where ``amax`` and ``amin`` were two; on CPU
    ``max(amax, -amin)`` was 6-13x faster than ``vector_norm(ord=inf)``)."""
    if (
        x.is_cpu
        and out.is_cpu
        and x.dtype in DTYPES
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
        and (ext := ready(start=False)) is not None
    ):
        ext.absmax_into(x, out, k)  # reads data pointers, no autograd record; checks out
        return
    with torch.no_grad():
        lo, hi = torch.aminmax(x)
        out[k] = torch.maximum(out[k], torch.maximum(hi, -lo).to(out.dtype))


def head_norm_max(x: torch.Tensor) -> torch.Tensor:
    """Per head, the largest row norm of ``x`` [B, H, T, D] over batch and positions ([H],
    fp32, NaN if any row is): the attention bound's q / k pass. The kernel on CPU (any
    strides but a dense last dim, fp32/bf16/fp16, eager, once built: this never builds it)
    reads x once, a strided view included; elsewhere ``vector_norm(x, dtype=fp32).amax``,
    which accumulates a 16-bit x in fp32 without an fp32 copy of it (torch's CUDA norm
    kernel casts and reduces in one pass; a float64 x is cast first: the op refuses to
    narrow)."""
    if (
        x.is_cpu
        and x.dim() == 4
        and x.dtype in DTYPES
        and x.stride(-1) == 1
        and not torch.compiler.is_compiling()
        and (ext := ready(start=False)) is not None
    ):
        return ext.head_norm_max(x)
    if x.dtype == torch.float64:
        x = x.float()
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).amax(dim=(0, 2))


def adamw_sums(p, g, state: dict, group: dict, coef: float) -> torch.Tensor | None:
    """[sum of the squared AdamW change, of p^2, of g^2 / v_hat] (fp32, summed in float64)
    for the step about to be
    taken on ``p`` with gradient ``coef * g``: ``param_stats.adamw_terms``'s three sums from
    one read of p, g and the moments, on CPU for fp32 contiguous tensors once the kernel is
    built (this never builds it); None elsewhere (the caller runs the torch ops)."""
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    ts = (p, g) if not state else (p, g, m, v)
    if (
        any(
            t is None or not t.is_cpu or t.dtype != torch.float32 or not t.is_contiguous()
            for t in ts
        )  # fmt: skip
        or torch.compiler.is_compiling()
        or (ext := ready(start=False)) is None
    ):
        return None
    step = float(state["step"]) + 1 if state else 1.0
    b1, b2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    m, v = (m, v) if state else (p, p)  # not read on the first step
    out = ext.adamw_sums(p, g, m, v, bool(state), coef, lr, wd, eps, b1, b2, step)
    return out.float()


def fused_rms_norm(kind, x, weight, eps, act):
    """RMSNorm (``kind="rmsnorm"``, gamma [D]) or ScaleNorm (``"scalenorm"``, scalar g) with
    fp32 statistics, output in ``act``. Call only when ``available()`` and ``supports``."""
    w = None if weight is None else weight.to(act)  # explicit casts gamma first, too
    if w is not None and w.dim() == 0:
        w = w.expand(x.shape[-1])  # ScaleNorm's g: the backward of expand sums dgamma
    return _FusedRMSNorm.apply(x, w, float(eps), kind == "rmsnorm", act)


def main(argv: list[str] | None = None) -> int:
    """``python -m stabilize.cpu_kernels build``: build (or find) the kernel, print where."""
    p = argparse.ArgumentParser(prog="python -m stabilize.cpu_kernels", description=main.__doc__)
    p.add_argument("command", choices=["build"])
    p.parse_args(argv)
    t0 = time.monotonic()
    if load() is None:
        print(f"fused CPU RMSNorm kernel unavailable: {unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"fused CPU RMSNorm kernel: {load().__file__} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
