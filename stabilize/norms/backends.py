"""Backends: functions over a ``NormType`` that run it in a given precision.

- ``explicit``: the type's ``normalize`` in the reduction dtype; honours every reduction dtype.
- ``torch``: the type's ``torch_forward`` (``F.layer_norm`` / ``F.rms_norm``). These
  accumulate in at least fp32 whatever the input, so they can honour ``fp32`` (and ``input``
  for fp32/fp64 inputs) but never a 16-bit reduction: asking for one is an error, not a
  silent fallback.
- ``compiled``: ``torch.compile`` of the explicit form. Inductor computes 16-bit math in
  fp32 internally, so the same restriction as ``torch`` applies.
- ``apex``: the type's ``apex_forward``, NVIDIA apex's fused kernels (CUDA only; fp32
  statistics).
- ``fused``: the type's ``fused_forward``, stabilize.cpu_kernels' C++ kernel, built on first
  use unless built ahead (CPU only; fp32 statistics; fp32/bf16/fp16 inputs; RMSNorm and
  ScaleNorm).
- ``auto``: the fastest backend that honours the setting on the device at hand. On CPU,
  ``F.rms_norm`` is unfused (6-21x slower than ``F.layer_norm`` in 16-bit and ~3-5x in
  fp32 at [4096, 2048] fwd+bwd, torch 2.13), so auto runs a type with a ``fused_forward``
  there, else (no compiler or ninja, a failed build or one still running in the background,
  fp64 input, inside torch.compile) ``compiled``; scripts/bench_norms.py measures it.

What "reduce in fp16" means here: the statistics are *stored* in the reduction dtype, as
eager PyTorch computes them in a hand-written fp16 norm (``torch.sum`` accumulates in fp32
internally and rounds the result to fp16). So the overflow at sum > 65504 is reproduced
exactly; the slow drift of a naive fp16 running sum is not modelled.
"""

from __future__ import annotations

import functools
import shutil

import torch

from stabilize import cpu_kernels
from stabilize.compat import dynamo_config
from stabilize.norms.registry import NormType, get_norm_type
from stabilize.numerics import dtype_from_name

BACKENDS = ("auto", "torch", "explicit", "compiled", "apex", "fused")
# Backends that compute statistics in max(input dtype, fp32), whatever they are asked.
FP32_BACKENDS = ("torch", "compiled", "apex", "fused")

APEX_HELP = (
    "NVIDIA apex is not importable. It is not on PyPI (the PyPI package named 'apex' is an "
    "unrelated web toolkit). Use an NGC PyTorch container (nvcr.io/nvidia/pytorch, which "
    "ships apex; see the Dockerfile) or build it from source with nvcc: "
    "https://github.com/NVIDIA/apex#installation. Or choose norm.backend=auto."
)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype on this device, or None when autocast is off."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the rest of the network computes in: autocast's, else the input's."""
    return autocast_dtype(x.device.type) or x.dtype


def _affine(y, weight, bias, act):
    y = y.to(act)
    if weight is not None:
        y = y * weight.to(act)
    if bias is not None:
        y = y + bias.to(act)
    return y


def _explicit(spec: NormType, x, weight, bias, eps, red, act):
    """(output, statistic): the statistic is [..., 1] in ``red``, eps included: inf for
    exactly the rows whose reduction overflowed."""
    y, stat = spec.normalize(x.to(red), eps)
    return _affine(y, weight, bias, act), stat


def explicit_norm(kind: str | NormType, x, weight, bias, eps, red, act):
    """The written-out norm: statistics in ``red``, result cast to ``act``, then affine.

    The sum of squares is stored in ``red``, so in fp16 it overflows to inf exactly when a
    real fp16 kernel's would (sum > 65504); x * rsqrt(inf) = 0 then zeroes the row.
    """
    spec = get_norm_type(kind) if isinstance(kind, str) else kind
    return _explicit(spec, x, weight, bias, eps, red, act)[0]


def apex_norm(spec: NormType, x, weight, bias, eps, act):
    try:
        from apex.normalization import fused_layer_norm as fln  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(APEX_HELP) from e
    if x.device.type != "cuda":
        raise ValueError(f"norm.backend='apex' needs CUDA tensors, got device {x.device.type!r}")
    return spec.apex_forward(fln, x, weight, bias, eps, act)


_compiled = None


def compiled_norm(spec: NormType, x, weight, bias, eps, act):
    """torch.compile of the explicit form with an fp32 (or fp64) reduction."""
    global _compiled
    if _compiled is None:
        # Every (type, dtype, activation dtype, affine, grad mode) combination is one more
        # compiled variant of this one function; past dynamo's recompile limit (8) it would
        # silently run eager. A model has a handful; a sweep in one process has more.
        cfg = dynamo_config()
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        _compiled = torch.compile(explicit_norm, dynamic=None)
    red = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _compiled(spec, x, weight, bias, eps, red, act)


def run_backend(backend: str, spec: NormType, x, weight, bias, eps, reduction: str, act):
    """(output, statistic or None) of a resolved ``backend``; only ``explicit`` has the
    per-row statistic (the others reduce inside a kernel) and reads ``reduction``, the name
    of the reduction dtype (the others were checked to reduce in it already)."""
    if backend == "explicit":
        red = x.dtype if reduction == "input" else dtype_from_name(reduction)
        return _explicit(spec, x, weight, bias, eps, red, act)
    if backend == "compiled":
        return compiled_norm(spec, x, weight, bias, eps, act), None
    if backend == "fused":
        return spec.fused_forward(x, weight, eps, act), None
    if backend == "apex":
        return apex_norm(spec, x, weight, bias, eps, act), None
    return spec.torch_forward(x, weight, bias, eps, act), None


@functools.cache
def has_cpp_compiler() -> bool:
    """Inductor on CPU needs a C++ compiler; without one, compiled norms cannot run."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def auto_backend(kind: str, device_type: str, dtype: torch.dtype | None = None) -> str:
    """The fastest backend for a norm whose reduction a fused kernel can honour.

    PyTorch's own kernel where it is fast: on CUDA, and everywhere for a type that says so
    (``torch_on_every_device``: LayerNorm). On CPU, for a type with a ``fused_forward``,
    the fused kernel once it is built (``cpu_kernels.ready``: the first call starts the build
    in the background and this falls back until it is done). Inside torch.compile it is
    skipped: an opaque C++ call would break the graph, and the compiled explicit form traces
    into it instead.
    """
    spec = get_norm_type(kind)
    if spec.supports("torch") and (spec.torch_on_every_device or device_type == "cuda"):
        return "torch"
    if device_type != "cpu":
        return "explicit"
    if (
        spec.supports("fused")
        and dtype in (None, *cpu_kernels.DTYPES)
        and not torch.compiler.is_compiling()
        and cpu_kernels.ready() is not None
    ):
        return "fused"
    return "compiled" if has_cpp_compiler() else "explicit"


def fused_reduction_ok(red_name: str, x_dtype: torch.dtype) -> bool:
    """Can a backend that reduces in max(x.dtype, fp32) honour ``red_name`` for this input?"""
    if red_name == "fp32":
        return x_dtype in (torch.float32, torch.float16, torch.bfloat16)
    if red_name == "input":
        return x_dtype in (torch.float32, torch.float64)
    return False
