"""``Norm``, the nn.Module every normalization in the model is, and its factory.

Why this module exists: under autocast PyTorch silently runs some norms in fp32, so a knob
that says "reduce in fp16" does nothing unless the norm turns autocast off and casts by
hand. Every ``Norm`` does that: the statistics (mean, sum of squares) are computed in the
*reduction dtype*, eps is added in that dtype, and only the normalized result is cast to
the *activation dtype* (autocast's dtype when autocast is on, else the input's), in which
gamma and beta are applied. docs/norms.md explains the choices.

What differs between norm types lives in their ``NormType`` (registry.py, zoo.py); what
differs between backends in backends.py. This module only holds the parameters, resolves
the backend for an input and calls it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from stabilize import cpu_kernels
from stabilize.norms.backends import (
    APEX_HELP,
    FP32_BACKENDS,
    activation_dtype,
    auto_backend,
    autocast_dtype,
    fused_reduction_ok,
    run_backend,
)
from stabilize.norms.config import REDUCTION_DTYPES, NormConfig, check_backend_supports
from stabilize.norms.registry import get_norm_type
from stabilize.validate import check_choice, check_positive


class Norm(nn.Module):
    """One normalization layer over the last dimension, of the registered type ``cfg.type``.

    ``reduction_dtype`` may be changed on a live model (the fp32_reduction remedy does so);
    the backend is then re-checked.
    """

    def __init__(self, dim: int, cfg: NormConfig):
        super().__init__()
        check_positive("norm dim", dim, integer=True)
        self.kind = cfg.type
        self.spec = get_norm_type(cfg.type)
        self.dim = dim
        self.eps = float(cfg.eps)
        self.backend = cfg.backend
        self._reduction = "fp32"
        self.reduction_dtype = cfg.reduction_dtype
        weight = bias = None
        if cfg.affine:
            weight = nn.Parameter(torch.empty(self.spec.weight_shape(dim)))
            if self.spec.has_bias and cfg.bias:
                bias = nn.Parameter(torch.empty(dim))
        self.weight = weight
        self.bias = bias
        self.reset_parameters()
        # Set by a monitor (stabilize.stability.probe.StabilityProbe): every training forward hands
        # it its input and, for the explicit backend, the per-row statistic (inf where the
        # reduction overflowed), as ``stats_sink.record_norm(stats_index, x, ms, kind)``.
        # A call from forward, not a forward hook: hooks put every call of the module on
        # nn.Module's slow path.
        self.stats_sink = None
        self.stats_index = -1

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight is not None:
            self.weight.fill_(self.spec.weight_init(self.dim))
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
        fused_ok = fused_reduction_ok(self._reduction, x.dtype)
        if self.backend == "auto":
            return auto_backend(self.kind, x.device.type, x.dtype) if fused_ok else "explicit"
        if self.backend in FP32_BACKENDS and not fused_ok:
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
        # in the backends are the whole truth about precision here.
        off = torch.autocast(dev, enabled=False) if amp is not None else contextlib.nullcontext()
        with off:
            y, ms = run_backend(
                backend, self.spec, x, self.weight, self.bias, self.eps, self._reduction, act
            )
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
