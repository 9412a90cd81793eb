"""The quantized GEMMs the probe watches: their operands' headroom (stabilize/quant/).

A Linear whose matmul runs in 8 bits, torchao's ``Float8Linear`` (a model converted with
``convert_to_float8_training``, by us or by the user), is found by duck type (its class
name and its ``config``, torchao imported by no one here) and its recipe read off that
config: per operand the scaling granularity (tensorwise or rowwise), the target format
(E4M3 or E5M2) and whether scales are rounded to powers of two. For each site three
operands are measured, as the GEMMs see them:

- ``x``: fprop's input (a forward pre-hook);
- ``w``: fprop's weight (the same hook);
- ``dy``: dgrad's grad-output, the gradient of the Linear's output (a hook on that tensor);
- ``wx``, ``wdy``: the wgrad GEMM's own input and grad-output, where the layer has them
  (our ``QuantLinear`` under ``quant.nvfp4.rht``: mixed along the tokens and quantized in
  blocks of 16 tokens); elsewhere wgrad reuses ``x`` and ``dy`` and these are not logged.

Per operand the six numbers of ``stabilize.quant.headroom.Headroom`` (amax, amax over the
format's max after scaling, saturated share counted before the cast, underflow share,
clipped groups, SQNR), computed with the same scaling the layer uses (current scaling:
from the tensor itself), on the probe's logged steps (every step while a monitor, the
``quant`` one by default, reads them), into max slots of the probe's buffer
(so every rank and micro-batch folds to the worst, and the step stays one host sync). The
SQNR rides negated (a max slot folds it to the lowest); an exact quantization's SQNR, +inf,
rides as ``EXACT_DB``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from stabilize.quant.formats import overflows
from stabilize.quant.headroom import Headroom, headroom, headroom_of
from stabilize.quant.linear import QuantLinear
from stabilize.quant.quantize import Quantized, Scheme

OPERANDS = ("x", "w", "dy", "wx", "wdy")
METRICS = Headroom.names()  # amax, amax_ratio, saturated, underflow, clipped_blocks, sqnr_db
EXACT_DB = 1e9  # the SQNR of an exact quantization (a zero tensor, values on the grid)
PER_SITE = len(OPERANDS) * len(METRICS)
# StepStats fields and their metric (stabilize/monitors/events.py SERIES_METRICS)
FIELDS = {
    "quant_amax": "amax",
    "quant_amax_ratio": "amax_ratio",
    "quant_saturated": "saturated",
    "quant_underflow": "underflow",
    "quant_clipped": "clipped_blocks",
    "quant_sqnr_db": "sqnr_db",
}
SERIES = frozenset(FIELDS)  # what a monitor declares to have them on every step
_ELEM = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@dataclass(frozen=True)
class QuantSite:
    name: str
    module: nn.Module
    schemes: tuple[Scheme, Scheme, Scheme]  # x, w, dy


def _scheme(cast, pow2: bool) -> Scheme:
    kind = "rowwise" if str(cast.scaling_granularity.value) == "axiswise" else "tensor"
    return Scheme(kind, _ELEM.get(cast.target_dtype, "e4m3"), pow2=pow2)


def find_quantized(model: nn.Module) -> list[QuantSite]:
    """Every torchao ``Float8Linear`` of ``model``, in module order, with its schemes."""
    sites = []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):  # ours: it hands the probe each operand as cast
            sites.append(QuantSite(name, m, m.schemes))
            continue
        cfg = getattr(m, "config", None)
        if type(m).__name__ != "Float8Linear" or not hasattr(cfg, "cast_config_input"):
            continue
        pow2 = bool(getattr(cfg, "round_scales_to_power_of_2", False))
        casts = (cfg.cast_config_input, cfg.cast_config_weight, cfg.cast_config_grad_output)
        sites.append(QuantSite(name, m, tuple(_scheme(c, pow2) for c in casts)))
    return sites


def measure(t: torch.Tensor, scheme: Scheme, qz: Quantized | None = None) -> torch.Tensor:
    """The six numbers of ``t`` as one fp32 vector for max slots (SQNR negated); ``qz``:
    ``t`` as the layer itself quantized it (its scale), else quantized here."""
    with torch.no_grad():
        hr = headroom_of(qz, t) if qz is not None else headroom(t.detach().float(), scheme)
        v = hr.stack()
        v[-1] = -torch.clamp(v[-1], max=EXACT_DB)
    return v


def measure_light(qz: Quantized) -> torch.Tensor:
    """Between log steps: from the layer's own cast, each scale group's largest value only
    (its amax times its scale: no pass over the tensor): the amax, the largest value over
    the format's max, and the share of groups whose largest value the cast clips; the
    element shares and the SQNR not measured (-inf)."""
    with torch.no_grad():
        fmt, a = qz.scheme.fmt, qz.group_amax.float()
        top = a / qz.scale if qz.decode else a * qz.scale  # [G, 1]: each group's largest
        ninf = torch.full((), -math.inf, device=a.device)
        if not a.numel():
            return torch.stack([ninf.clamp(min=0)] * 2 + [ninf] * 4)
        clipped = overflows(top, fmt).float().mean()
        return torch.stack([a.amax(), top.amax() / fmt.max, ninf, ninf, clipped, ninf])


def unpack_sites(sites: list[QuantSite], values: list[float]) -> dict[str, dict[str, float]]:
    """Host values of the sites' slots -> one dict per ``FIELDS`` entry, keyed
    ``<layer>.<operand>``; an operand not measured this step (its slots still -inf) is
    left out. ``quant_edge``: each measured delayed-scaling operand's saturation edge on the
    amax ratio (the format's ``overflow_from`` over its max)."""
    out: dict[str, dict[str, float]] = {f: {} for f in (*FIELDS, "quant_edge")}
    for i, site in enumerate(sites):
        for j, op in enumerate(OPERANDS):
            o = (i * len(OPERANDS) + j) * len(METRICS)
            vals = dict(zip(METRICS, values[o : o + len(METRICS)], strict=True))
            if vals["amax"] == float("-inf"):
                continue
            scheme = site.schemes[j] if j < len(site.schemes) else None  # wgrad's: none
            if scheme is not None and scheme.kind == "delayed":
                out["quant_edge"][f"{site.name}.{op}"] = scheme.fmt.overflow_from / scheme.fmt.max
            vals["sqnr_db"] = -vals["sqnr_db"]
            for field, metric in FIELDS.items():
                if math.isfinite(vals[metric]) or metric in ("amax", "amax_ratio"):
                    out[field][f"{site.name}.{op}"] = vals[metric]
    return out


def attach(probe, sites: list[QuantSite], offset: int) -> list:
    """The hooks that write each site's operands into ``probe.buf`` from ``offset`` on
    (training forwards; no host sync); their handles. Every count on logged steps; between
    them, while a monitor reads the series, our ``QuantLinear``'s amax, ratio and clipped
    groups off its own cast's group maxima (torchao's current scaling cannot saturate: not
    measured)."""

    def write(o: int, t: torch.Tensor, scheme: Scheme, qz: Quantized | None = None) -> None:
        buf = probe.buf
        if buf is not None:
            v = measure(t, scheme, qz) if qz is None or probe.logged else measure_light(qz)
            buf[o : o + len(METRICS)] = torch.maximum(buf[o : o + len(METRICS)], v)

    def due(module) -> bool:  # logged steps; ours on every step while a monitor reads them
        live = probe.logged or (probe.quant_always and isinstance(module, QuantLinear))
        return module.training and probe.buf is not None and live

    handles, n = [], len(METRICS)
    for i, site in enumerate(sites):
        o = offset + i * PER_SITE
        if isinstance(site.module, QuantLinear):
            handles.append(_Callback(site.module, o, write, due))
            continue
        sx, sw, sdy = site.schemes

        def pre(module, args, o=o, sx=sx, sw=sw):
            if due(module) and args:
                write(o, args[0], sx)
                write(o + n, module.weight, sw)

        def post(module, args, out, o=o + 2 * n, sdy=sdy):
            if due(module) and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: write(o, g, sdy))  # returns None: g unchanged

        handles.append(site.module.register_forward_pre_hook(pre))
        handles.append(site.module.register_forward_hook(post))
    return handles


class _Callback:
    """``QuantLinear.on_quantized`` set to write into the probe, as a removable handle."""

    def __init__(self, module: QuantLinear, offset: int, write, due):
        self.module = module

        def on_quantized(i: int, qz: Quantized, t: torch.Tensor) -> None:
            if due(module):
                write(offset + i * len(METRICS), t, qz.scheme, qz)

        module.on_quantized = on_quantized

    def remove(self) -> None:
        self.module.on_quantized = None
