"""The normalization zoo: LayerNorm, RMSNorm and ScaleNorm with an honest reduction dtype.

Why this file exists: under autocast PyTorch silently runs some norms in fp32, so a knob
that says "reduce in fp16" does nothing unless the norm turns autocast off and casts by
hand. Every norm here does that: the statistics (mean, sum of squares) are computed in the
*reduction dtype*, eps is added in that dtype, and only the normalized result is cast to
the *activation dtype* (autocast's dtype when autocast is on, else the input's), in which
gamma and beta are applied. docs/norms.md explains the choices.

Backends:
- ``explicit``: the formula written out in tensor ops; honours every reduction dtype.
- ``torch``: ``F.layer_norm`` / ``F.rms_norm``. These accumulate in at least fp32
  whatever the input, so they can honour ``fp32`` (and ``input`` for fp32/fp64 inputs)
  but never a 16-bit reduction: asking for one is an error, not a silent fallback.
- ``compiled``: ``torch.compile`` of the explicit form. Inductor computes 16-bit math in
  fp32 internally, so the same restriction as ``torch`` applies.
- ``apex``: NVIDIA apex's fused kernels (CUDA only; fp32 statistics).
- ``fused``: RMSNorm/ScaleNorm by stabilize.cpu_kernels, a C++ kernel JIT-built on first use
  (CPU only; fp32 statistics; fp32/bf16/fp16 inputs).
- ``auto``: the fastest backend that honours the setting on the device at hand. On CPU,
  ``F.rms_norm`` is unfused (6-21x slower than ``F.layer_norm`` in 16-bit and ~3-5x in
  fp32 at [4096, 2048] fwd+bwd, torch 2.13), so auto runs RMSNorm/ScaleNorm ``fused`` there,
  else (no compiler or ninja, a failed build, fp64 input, inside torch.compile) ``compiled``;
  scripts/bench_norms.py measures it.

What "reduce in fp16" means here: the statistics are *stored* in the reduction dtype, as
eager PyTorch computes them in a hand-written fp16 norm (``torch.sum`` accumulates in fp32
internally and rounds the result to fp16). So the overflow at sum > 65504 is reproduced
exactly; the slow drift of a naive fp16 running sum is not modelled.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stabilize import cpu_kernels
from stabilize.numerics import dtype_from_name
from stabilize.validate import check_choice, check_positive

NORM_TYPES = ("layernorm", "rmsnorm", "scalenorm")
REDUCTION_DTYPES = ("fp32", "bf16", "fp16", "input")
BACKENDS = ("auto", "torch", "explicit", "compiled", "apex", "fused")
PLACEMENTS = ("pre", "post", "sandwich", "deepnorm")
# Backends that compute statistics in max(input dtype, fp32), whatever they are asked.
_FP32_BACKENDS = ("torch", "compiled", "apex", "fused")

APEX_HELP = (
    "NVIDIA apex is not importable. It is not on PyPI (the PyPI package named 'apex' is an "
    "unrelated web toolkit). Use an NGC PyTorch container (nvcr.io/nvidia/pytorch, which "
    "ships apex; see the Dockerfile) or build it from source with nvcc: "
    "https://github.com/NVIDIA/apex#installation. Or choose norm.backend=auto."
)


@dataclass
class NormConfig:
    """Everything about normalization that a sweep may vary.

    type/eps/affine/bias/reduction_dtype/backend describe one norm module; placement and the
    three switches say where the model puts norms (consumed by stabilize.model).
    """

    type: str = "layernorm"
    eps: float = 1e-5
    affine: bool = True
    bias: bool = True  # LayerNorm's beta; ignored by RMSNorm/ScaleNorm, which have none
    reduction_dtype: str = "fp32"
    backend: str = "auto"
    placement: str = "pre"
    final_norm: bool = True
    embed_norm: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        check_choice("norm.type", self.type, NORM_TYPES)
        check_positive("norm.eps", self.eps)
        check_choice("norm.reduction_dtype", self.reduction_dtype, REDUCTION_DTYPES)
        check_choice("norm.backend", self.backend, BACKENDS)
        check_choice("norm.placement", self.placement, PLACEMENTS)
        check_backend_supports(self.backend, self.reduction_dtype, self.type)


def check_backend_supports(backend: str, reduction_dtype: str, kind: str | None = None) -> None:
    """Fail early when a backend can never honour the reduction dtype (or norm type)."""
    if backend == "fused" and kind == "layernorm":
        raise ValueError(
            "norm.backend='fused' cannot run norm.type='layernorm': it fuses RMSNorm and "
            "ScaleNorm only. Use norm.backend='auto' (F.layer_norm)."
        )
    if backend in _FP32_BACKENDS and reduction_dtype in ("bf16", "fp16"):
        raise ValueError(
            f"norm.backend={backend!r} cannot honour norm.reduction_dtype={reduction_dtype!r}: "
            f"it always accumulates in fp32. Allowed for a 16-bit reduction: "
            f"['explicit', 'auto']"
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


def _explicit(kind, x, weight, bias, eps, red, act):
    """(output, statistic): the statistic is the mean square (sum for ScaleNorm) plus eps,
    [..., 1] in ``red``: inf for exactly the rows whose reduction overflowed."""
    d = x.shape[-1]
    xr = x.to(red)
    if kind == "layernorm":
        xr = xr - xr.sum(-1, keepdim=True) / d
    ss = xr.square().sum(-1, keepdim=True)  # [..., 1], in red
    ms = ss + eps if kind == "scalenorm" else ss / d + eps  # eps added in red
    return _affine(xr * torch.rsqrt(ms), weight, bias, act), ms


def explicit_norm(kind, x, weight, bias, eps, red, act):
    """The written-out norm: statistics in ``red``, result cast to ``act``, then affine.

    The sum of squares is stored in ``red``, so in fp16 it overflows to inf exactly when a
    real fp16 kernel's would (sum > 65504); x * rsqrt(inf) = 0 then zeroes the row.
    """
    return _explicit(kind, x, weight, bias, eps, red, act)[0]


def torch_norm(kind, x, weight, bias, eps, act):
    """PyTorch's own kernels (statistics in at least fp32)."""
    d = x.shape[-1]
    if kind == "layernorm":
        w = None if weight is None else weight.to(x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        return F.layer_norm(x, (d,), w, b, eps).to(act)
    if kind == "rmsnorm":
        w = None if weight is None else weight.to(x.dtype)
        return F.rms_norm(x, (d,), w, eps).to(act)
    # ScaleNorm: x / sqrt(sum x^2 + eps) = rms_norm(x, eps / d) / sqrt(d)
    y = F.rms_norm(x, (d,), None, eps / d).to(act)
    g = (weight if weight is not None else torch.ones((), device=x.device)) / math.sqrt(d)
    return y * g.to(act)


def apex_norm(kind, x, weight, bias, eps, act):
    try:
        from apex.normalization import fused_layer_norm as fln  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(APEX_HELP) from e
    if x.device.type != "cuda":
        raise ValueError(f"norm.backend='apex' needs CUDA tensors, got device {x.device.type!r}")
    d = x.shape[-1]
    if kind == "layernorm":
        if weight is None:
            return fln.fused_layer_norm(x, (d,), eps).to(act)
        if bias is None:  # apex's affine LayerNorm always has a bias
            bias = torch.zeros_like(weight)
        return fln.fused_layer_norm_affine(x, weight.to(x.dtype), bias.to(x.dtype), (d,), eps).to(
            act
        )
    if kind == "rmsnorm":
        if weight is None:
            return fln.fused_rms_norm(x, (d,), eps).to(act)
        return fln.fused_rms_norm_affine(x, weight.to(x.dtype), (d,), eps).to(act)
    y = fln.fused_rms_norm(x, (d,), eps / d).to(act)
    g = (weight if weight is not None else torch.ones((), device=x.device)) / math.sqrt(d)
    return y * g.to(act)


_compiled = None


def compiled_norm(kind, x, weight, bias, eps, act):
    """torch.compile of the explicit form with an fp32 (or fp64) reduction."""
    global _compiled
    if _compiled is None:
        # Every (kind, dtype, activation dtype, affine, grad mode) combination is one more
        # compiled variant of this one function; past dynamo's recompile limit (8) it would
        # silently run eager. A model has a handful; a sweep in one process has more.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        _compiled = torch.compile(explicit_norm, dynamic=None)
    red = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _compiled(kind, x, weight, bias, eps, red, act)


@functools.cache
def has_cpp_compiler() -> bool:
    """Inductor on CPU needs a C++ compiler; without one, compiled norms cannot run."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def auto_backend(kind: str, device_type: str, dtype: torch.dtype | None = None) -> str:
    """The fastest backend for a norm whose reduction a fused kernel can honour.

    On CPU the first call for RMSNorm/ScaleNorm builds the fused kernel (once, ~30-40 s cold).
    Inside torch.compile it is skipped: an opaque C++ call would break the graph, and the
    compiled explicit form traces into it instead.
    """
    if kind == "layernorm" or device_type == "cuda":
        return "torch"
    if device_type != "cpu":
        return "explicit"
    if (
        dtype in (None, *cpu_kernels.DTYPES)
        and not torch.compiler.is_compiling()
        and cpu_kernels.available()
    ):
        return "fused"
    return "compiled" if has_cpp_compiler() else "explicit"


def _fused_reduction_ok(red_name: str, x_dtype: torch.dtype) -> bool:
    """Can a backend that reduces in max(x.dtype, fp32) honour ``red_name`` for this input?"""
    if red_name == "fp32":
        return x_dtype in (torch.float32, torch.float16, torch.bfloat16)
    if red_name == "input":
        return x_dtype in (torch.float32, torch.float64)
    return False


class Norm(nn.Module):
    """One normalization layer over the last dimension.

    ``reduction_dtype`` may be changed on a live model (the fp32_reduction remedy does so);
    the backend is then re-checked.
    """

    def __init__(self, dim: int, cfg: NormConfig):
        super().__init__()
        check_positive("norm dim", dim, integer=True)
        self.kind = cfg.type
        self.dim = dim
        self.eps = float(cfg.eps)
        self.backend = cfg.backend
        self._reduction = "fp32"
        self.reduction_dtype = cfg.reduction_dtype
        weight = bias = None
        if cfg.affine:
            weight = nn.Parameter(torch.empty(() if self.kind == "scalenorm" else (dim,)))
            if self.kind == "layernorm" and cfg.bias:
                bias = nn.Parameter(torch.empty(dim))
        self.weight = weight
        self.bias = bias
        self.reset_parameters()
        # Set by a monitor (stabilize.lit.probe.StabilityProbe): every training forward hands
        # it its input and, for the explicit backend, the per-row statistic (inf where the
        # reduction overflowed), as ``stats_sink.record_norm(stats_index, x, ms, kind)``.
        # A call from forward, not a forward hook: hooks put every call of the module on
        # nn.Module's slow path.
        self.stats_sink = None
        self.stats_index = -1

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight is not None:
            # Nguyen & Salazar 2019 initialise ScaleNorm's g = sqrt(d): it then starts as RMSNorm.
            self.weight.fill_(math.sqrt(self.dim) if self.kind == "scalenorm" else 1.0)
        if self.bias is not None:
            self.bias.zero_()

    @property
    def reduction_dtype(self) -> str:
        return self._reduction

    @reduction_dtype.setter
    def reduction_dtype(self, value: str) -> None:
        check_choice("norm.reduction_dtype", value, REDUCTION_DTYPES)
        check_backend_supports(self.backend, value, self.kind)
        self._reduction = value

    def resolve_backend(self, x: torch.Tensor) -> str:
        """The backend that will run for this input (auto resolved, settings checked)."""
        fused_ok = _fused_reduction_ok(self._reduction, x.dtype)
        if self.backend == "auto":
            return auto_backend(self.kind, x.device.type, x.dtype) if fused_ok else "explicit"
        if self.backend in _FP32_BACKENDS and not fused_ok:
            raise ValueError(
                f"norm.backend={self.backend!r} cannot honour "
                f"norm.reduction_dtype={self._reduction!r} for {x.dtype} input: it reduces in "
                f"max(input dtype, fp32). Use norm.backend='explicit' or 'auto'."
            )
        if self.backend == "fused":
            act = activation_dtype(x)
            if not cpu_kernels.supports(x, act):
                raise ValueError(
                    f"norm.backend='fused' cannot run a {x.device.type} {x.dtype} input with "
                    f"activation dtype {act}: it is a CPU kernel for "
                    f"{[str(d) for d in cpu_kernels.DTYPES]}. Use norm.backend='auto'."
                )
            if not cpu_kernels.available():
                raise RuntimeError(
                    f"norm.backend='fused': the CPU kernel could not be built "
                    f"({cpu_kernels.unavailable_reason()}). Use norm.backend='auto'."
                )
        return self.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        amp = autocast_dtype(dev)
        act = amp or x.dtype
        backend = self.resolve_backend(x)
        # Autocast off (it would run sum/pow/layer_norm in fp32 behind our back): the casts
        # below are the whole truth about precision here.
        off = torch.autocast(dev, enabled=False) if amp is not None else contextlib.nullcontext()
        with off:
            ms = None
            if backend == "explicit":
                red = x.dtype if self._reduction == "input" else dtype_from_name(self._reduction)
                y, ms = _explicit(self.kind, x, self.weight, self.bias, self.eps, red, act)
            elif backend == "compiled":
                y = compiled_norm(self.kind, x, self.weight, self.bias, self.eps, act)
            elif backend == "fused":
                y = cpu_kernels.fused_rms_norm(self.kind, x, self.weight, self.eps, act)
            elif backend == "apex":
                y = apex_norm(self.kind, x, self.weight, self.bias, self.eps, act)
            else:
                y = torch_norm(self.kind, x, self.weight, self.bias, self.eps, act)
            if self.stats_sink is not None and self.training:
                self.stats_sink.record_norm(self.stats_index, x, ms, self.kind)
            return y

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, {self.dim}, eps={self.eps:g}, reduction={self._reduction}, "
            f"backend={self.backend}, affine={self.weight is not None}"
        )


def build_norm(dim: int, cfg: NormConfig) -> Norm:
    """The one factory: a norm module over ``dim`` features as ``cfg`` describes."""
    if cfg.backend == "apex":
        try:
            import apex.normalization  # noqa: F401  # type: ignore[import-not-found]
        except ImportError as e:
            raise RuntimeError(APEX_HELP) from e
    return Norm(dim, cfg)


def set_reduction_dtype(model: nn.Module, reduction_dtype: str) -> int:
    """Switch every norm in ``model`` to ``reduction_dtype`` in place; returns how many."""
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    for m in norms:
        m.reduction_dtype = reduction_dtype
    return len(norms)
