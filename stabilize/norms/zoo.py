"""The built-in norm types: LayerNorm, RMSNorm, ScaleNorm, one registered class each.

To add a sibling, write one more class like these (here or in any module imported before
the config is built), decorate it with ``@register_norm``, and add ``configs/norm/<name>.yaml``
and its tests; tests/test_norm_registry.py registers one from outside the package.

Signatures of the kernel backends (the statistics in at least fp32 whatever the input;
``act`` is the activation dtype the output must have):
``torch_forward(x, weight, bias, eps, act)``, ``apex_forward(fln, x, weight, bias, eps, act)``
with ``fln = apex.normalization.fused_layer_norm``, ``fused_forward(x, weight, eps, act)``
(CPU, only called when ``cpu_kernels.available()`` and ``cpu_kernels.supports``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from stabilize import cpu_kernels
from stabilize.norms.registry import NormType, register_norm


def _cast(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if p is None else p.to(dtype)


@register_norm
class LayerNorm(NormType):
    """Ba et al. 2016: (x - mean) / sqrt(var + eps) * gamma + beta."""

    name = "layernorm"
    has_bias = True
    torch_on_every_device = True
    unsupported = {
        "fused": "it fuses RMSNorm and ScaleNorm only. Use norm.backend='auto' (F.layer_norm)."
    }

    def normalize(self, x, eps):
        d = x.shape[-1]
        xc = x - x.sum(-1, keepdim=True) / d
        ms = xc.square().sum(-1, keepdim=True) / d + eps  # [..., 1]: variance + eps
        return xc * torch.rsqrt(ms), ms

    def reference64(self, x, eps):
        xc = x - x.mean(-1, keepdim=True)
        return xc / torch.sqrt((xc * xc).mean(-1, keepdim=True) + eps)

    def torch_forward(self, x, weight, bias, eps, act):
        d = x.shape[-1]
        return F.layer_norm(x, (d,), _cast(weight, x.dtype), _cast(bias, x.dtype), eps).to(act)

    def apex_forward(self, fln, x, weight, bias, eps, act):
        d = x.shape[-1]
        if weight is None:
            return fln.fused_layer_norm(x, (d,), eps).to(act)
        if bias is None:  # apex's affine LayerNorm always has a bias
            bias = torch.zeros_like(weight)
        w, b = weight.to(x.dtype), bias.to(x.dtype)
        return fln.fused_layer_norm_affine(x, w, b, (d,), eps).to(act)


@register_norm
class RMSNorm(NormType):
    """Zhang & Sennrich 2019: x / sqrt(mean(x^2) + eps) * gamma."""

    name = "rmsnorm"

    def normalize(self, x, eps):
        ms = x.square().sum(-1, keepdim=True) / x.shape[-1] + eps  # [..., 1]
        return x * torch.rsqrt(ms), ms

    def reference64(self, x, eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def torch_forward(self, x, weight, bias, eps, act):
        return F.rms_norm(x, (x.shape[-1],), _cast(weight, x.dtype), eps).to(act)

    def apex_forward(self, fln, x, weight, bias, eps, act):
        d = x.shape[-1]
        if weight is None:
            return fln.fused_rms_norm(x, (d,), eps).to(act)
        return fln.fused_rms_norm_affine(x, weight.to(x.dtype), (d,), eps).to(act)

    def fused_forward(self, x, weight, eps, act):
        return cpu_kernels.fused_rms_norm("rmsnorm", x, weight, eps, act)


def _times_g(y: torch.Tensor, weight: torch.Tensor | None, d: int, act) -> torch.Tensor:
    """ScaleNorm from an RMSNorm kernel's output: y * g / sqrt(D), in the activation dtype."""
    g = (weight if weight is not None else torch.ones((), device=y.device)) / math.sqrt(d)
    return y * g.to(act)


@register_norm
class ScaleNorm(NormType):
    """Nguyen & Salazar 2019: g * x / sqrt(sum(x^2) + eps), one learned scalar g."""

    name = "scalenorm"

    def weight_shape(self, dim):
        return ()

    def weight_init(self, dim):
        # Nguyen & Salazar 2019 initialise g = sqrt(d): it then starts as RMSNorm.
        return math.sqrt(dim)

    def normalize(self, x, eps):
        ms = x.square().sum(-1, keepdim=True) + eps  # [..., 1]: sum, not mean
        return x * torch.rsqrt(ms), ms

    def reference64(self, x, eps):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)

    def mean_square(self, stat, dim):
        return stat / dim

    # x / sqrt(sum x^2 + eps) = rms_norm(x, eps / d) / sqrt(d)
    def torch_forward(self, x, weight, bias, eps, act):
        d = x.shape[-1]
        return _times_g(F.rms_norm(x, (d,), None, eps / d).to(act), weight, d, act)

    def apex_forward(self, fln, x, weight, bias, eps, act):
        d = x.shape[-1]
        return _times_g(fln.fused_rms_norm(x, (d,), eps / d).to(act), weight, d, act)

    def fused_forward(self, x, weight, eps, act):
        return cpu_kernels.fused_rms_norm("scalenorm", x, weight, eps, act)
