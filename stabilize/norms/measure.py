"""What a module we did not build does to its input, measured on a few rows rather than
read from its attributes or its name (``find_norms``, surgery.py, is the reader):

- ``measure(m, width, eps)``: whether it normalizes its input's last dimension as LayerNorm or
  RMSNorm does (with gain ``weight`` or ``1 + weight``), and the dtype its statistic is
  really computed in;
- ``recover_eps(m, kind, offset, width)``: the eps of a norm that keeps it inside ``forward``
  (nanoGPT's ``F.layer_norm(x, ..., 1e-5)``), read off a row whose statistic is far below it;
- ``affine_leaf(m)``: a module worth measuring although its class says nothing (a leaf holding
  a 1-D ``weight`` and at most a bias of the same shape);
- ``inline_norms(model, seen)``: modules whose own ``forward`` computes a norm with
  ``F.layer_norm`` / ``F.rms_norm`` (or a module-level function that does): such a norm has no
  module of its own, so it can be neither probed nor swapped, and the caller says so.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from stabilize.norms.registry import get_norm_type

# The measured overflow: one fp16 element at 300 squares to 90000 > 65504.
PROBE_VALUE = 300.0
# eps where a module keeps its own inside forward and the measurement cannot tell it: torch's
# LayerNorm default (nanoGPT's too)
DEFAULT_EPS = 1e-5
# The eps probe's row RMS: its mean square (1e-8) is well below any usual eps (1e-6 .. 1e-5),
# so the output's scale is set by eps, and still far above fp32's smallest normal number.
EPS_PROBE_RMS = 1e-4
# Functional norms a forward can compute inline (the names its code object loads).
INLINE_NORM_CALLS = ("layer_norm", "rms_norm")


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False)


def _probe_rows(width: int, device) -> torch.Tensor:
    """[2, 3, D] fp32: six rows of different means and scales. Three dimensions, so that a
    module normalizing any other axis (GroupNorm's channels, a batch) cannot match."""
    base = torch.linspace(-1.0, 3.0, width, device=device)
    rows = [(1.0, 0.0), (0.5, 1.0), (2.0, -1.0), (3.0, 0.5), (0.25, 2.0), (1.5, -0.5)]
    return torch.stack([base * s + c for s, c in rows]).view(2, 3, width)


def _references(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float):
    """float64 candidates for a norm's output on ``x``: {(kind, unit_offset): y}."""
    x = x.double()
    normed = {kind: get_norm_type(kind).reference64(x, eps) for kind in ("layernorm", "rmsnorm")}
    shift = 0.0 if b is None else b.double()
    return {
        (kind, offset): y * ((1.0 + w) if offset else w) + shift
        for kind, y in normed.items()
        for offset in (False, True)
    }


def _bias(m: nn.Module) -> torch.Tensor | None:
    b = getattr(m, "bias", None)
    return b.detach().double() if isinstance(b, torch.Tensor) else None


@torch.no_grad()
def measure(m: nn.Module, width: int, eps: float) -> tuple[str, bool, str | None]:
    """(kind, unit offset, reduction dtype) of a module, from rows through its own forward
    (hooks bypassed, autocast off): fp32 rows of non-zero means matched against float64
    LayerNorm / RMSNorm, each with gain ``w`` or ``1 + w``; and an fp16 row of ones holding
    one 300, whose sum of squares overflows an fp16 reduction. ``unknown`` when it matches
    neither (or cannot take the rows)."""
    w = m.weight.detach()
    b = _bias(m)
    dev = w.device
    kind, offset, red = "unknown", False, None
    try:
        with _no_autocast(dev.type):
            x = _probe_rows(width, dev)
            y = m.forward(x).double()
            for (k, o), ref in _references(x, w.double(), b, eps).items():
                if y.shape == ref.shape and torch.allclose(y, ref, rtol=1e-2, atol=1e-3):
                    kind, offset = k, o
                    break
            x16 = torch.ones(1, width, device=dev, dtype=torch.float16)
            x16[0, 0] = PROBE_VALUE
            y16 = m.forward(x16)
            # an overflowed row is x * rsqrt(inf) = 0, plus the bias where there is one
            shift = 0.0 if b is None else b
            dead = not bool(torch.isfinite(y16).all()) or (
                bool((y16.double() == shift).all()) and bool((y != shift).any())
            )
            red = "fp16" if dead else "fp32"
    except Exception:  # a forward that cannot take the rows: what it measured stays
        pass
    return kind, offset, red


@torch.no_grad()
def recover_eps(m: nn.Module, kind: str, offset: bool, width: int) -> float | None:
    """The eps a norm of known ``kind`` adds to its statistic, measured: on a row of RMS
    ``EPS_PROBE_RMS`` (statistic s = 1e-8) its normalized output n = x / sqrt(s + eps), so
    eps = s ((n0 / n)^2 - 1) with n0 = x / sqrt(s), the float64 output at eps 0. Rounded to
    3 significant digits and checked against the module on that row; None where it cannot
    be read (a 16-bit statistic underflows there, a gain of zeros)."""
    w = m.weight.detach().double()
    gain = 1.0 + w if offset else w
    b = _bias(m)
    dev = m.weight.device
    try:
        with _no_autocast(dev.type):
            x = torch.linspace(-1.0, 1.0, width, device=dev)[None] * EPS_PROBE_RMS
            y = m.forward(x).double()
    except Exception:
        return None
    if y.shape != x.shape:
        return None
    spec, x64 = get_norm_type(kind), x.double()
    n0 = spec.reference64(x64, 0.0)
    n = (y - (0.0 if b is None else b)) / gain
    xc = x64 - x64.mean(-1, keepdim=True) if kind == "layernorm" else x64
    stat = xc.square().mean()  # the row's variance (layernorm) or mean square (rmsnorm)
    use = (gain.abs() > 1e-6) & (n0.abs() > 0.5) & (n.abs() > 0)
    if not bool(use.any()):
        return None
    est = float((stat * ((n0[use] / n[use]).square() - 1.0)).median())
    if not (est > 0 and est < 1.0):
        return None
    eps = float(f"{est:.3g}")
    ref = spec.reference64(x64, eps) * gain + (0.0 if b is None else b)
    return eps if torch.allclose(y, ref, rtol=1e-3, atol=0.0) else None


def affine_leaf(m: nn.Module) -> bool:
    """A leaf module whose parameters are a 1-D floating ``weight`` and at most a ``bias``
    of its shape, and which holds no buffers (running statistics a probe forward would
    move): what a norm written without an ``eps`` attribute looks like."""
    if next(m.children(), None) is not None or next(m.buffers(recurse=False), None) is not None:
        return False
    params = dict(m.named_parameters(recurse=False))
    w = params.get("weight")
    if w is None or w.dim() != 1 or not w.is_floating_point() or set(params) - {"weight", "bias"}:
        return False
    b = params.get("bias")
    return b is None or tuple(b.shape) == tuple(w.shape)


def _inline_calls(fn, depth: int = 1) -> list[str]:
    """The functional norms ``fn``'s code calls by name, and those of the module-level
    functions it calls (``depth`` levels: modded-nanogpt's ``norm(x)`` wraps ``F.rms_norm``)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = [n for n in INLINE_NORM_CALLS if n in code.co_names]
    if depth > 0:
        scope = getattr(fn, "__globals__", {})
        for name in code.co_names:
            g = scope.get(name)
            if isinstance(g, types.FunctionType) and g is not fn:
                found += [n for n in _inline_calls(g, depth - 1) if n not in found]
    return found


def inline_norms(model: nn.Module, seen: set[str]) -> list[tuple[str, str, str]]:
    """(path, class, calls) of each module not in ``seen`` (the norms found) whose class's
    ``forward`` computes ``F.layer_norm`` / ``F.rms_norm`` itself."""
    cache: dict[type, list[str]] = {}
    out = []
    for name, m in model.named_modules():
        if name in seen:
            continue
        cls = type(m)
        if cls not in cache:
            cache[cls] = _inline_calls(inspect.unwrap(cls.forward))
        if cache[cls]:
            out.append((name, cls.__name__, ", ".join(f"F.{c}" for c in cache[cls])))
    return out


def inline_line(found: list[tuple[str, str, str]]) -> str:
    """One line for ``inline_norms``'s list ('' when empty)."""
    if not found:
        return ""
    by_cls: dict[tuple[str, str], list[str]] = {}
    for path, cls, calls in found:
        by_cls.setdefault((cls, calls), []).append(path or "<model>")
    parts = [
        f"{calls} inside {cls}.forward ({len(p)} modules, e.g. {p[0]})"
        for (cls, calls), p in by_cls.items()
    ]
    return f"norms computed inline, not seen: {'; '.join(parts)}: neither probed nor swappable"
