"""Norm discovery and surgery on a model we did not build (issue 36, docs/design-your-model.md
sections 4-5).

- ``find_norms(model)``: every normalization module, by type (``nn.LayerNorm``,
  ``nn.RMSNorm``, our ``Norm``, Hugging Face's ``LlamaRMSNorm`` matched by class name) and by
  duck typing (a class name ending in ``Norm`` with a ``weight`` and an ``eps`` or
  ``variance_epsilon``). For a duck-typed class its kind (layernorm / rmsnorm, with or without
  a ``(1 + weight)`` gain) and the dtype its reduction really runs in are *measured* once on
  two rows, not guessed from its name.
- ``swap_norms(model, ...)``: replace found norms by the zoo's ``Norm`` of the same kind (or
  another), handing it the *same* ``nn.Parameter`` objects, so an optimizer built before the
  swap still holds them and the state-dict keys do not change.

No ``transformers`` import: its classes are recognised by name and attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stabilize.norms.backends import BACKENDS
from stabilize.norms.config import REDUCTION_DTYPES, NormConfig
from stabilize.norms.module import Norm, build_norm
from stabilize.norms.registry import NORM_TYPES, get_norm_type
from stabilize.validate import check_choice, check_positive

# What ``sites={name: {...}}`` may set per norm, over the shared arguments.
SITE_KEYS = ("type", "eps", "reduction_dtype")
# Known classes that upcast to fp32 before the mean of squares (matched by class name).
UPCASTING_RMSNORMS = ("LlamaRMSNorm",)
# The measured overflow: one fp16 element at 300 squares to 90000 > 65504.
PROBE_VALUE = 300.0


@dataclass(frozen=True)
class FoundNorm:
    """One normalization module of a model, as ``find_norms`` sees it."""

    name: str
    """Its path in ``model.named_modules()``, e.g. ``model.layers.0.input_layernorm``."""
    cls: str
    """Its class name."""
    kind: str
    """``layernorm`` | ``rmsnorm`` (a zoo ``Norm``: its own type) | ``unknown``."""
    eps: float | None
    width: int
    """Features normalized: the last dimension (from ``weight``, never a ``dim`` attribute)."""
    bias: bool
    reduction_dtype: str | None
    """The dtype its statistic is computed in: ``fp32`` for the known classes (they upcast),
    a zoo ``Norm``'s own setting, or for a duck-typed class measured with an fp16 row holding
    a 300: ``fp16`` when that row came out zero or non-finite (it reduces in its input's
    16-bit dtype), else ``fp32``; None when the measurement could not run."""
    unit_offset: bool = False
    """Its gain is ``(1 + weight)`` (Gemma; litgpt's ``add_unit_offset``)."""
    refusal: str = ""
    """Why ``swap_norms`` refuses it ('' when it can be swapped)."""
    module: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def swappable(self) -> bool:
        return not self.refusal


def _eps_of(m: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _is_duck_norm(m: nn.Module) -> bool:
    return (
        type(m).__name__.endswith("Norm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and _eps_of(m) is not None
    )


def _no_autocast(device_type: str):
    return torch.autocast(device_type, enabled=False)


def _references(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float):
    """float64 candidates for a norm's output on row ``x``: {(kind, unit_offset): y}."""
    x = x.double()
    normed = {kind: get_norm_type(kind).reference64(x, eps) for kind in ("layernorm", "rmsnorm")}
    shift = 0.0 if b is None else b.double()
    return {
        (kind, offset): y * ((1.0 + w) if offset else w) + shift
        for kind, y in normed.items()
        for offset in (False, True)
    }


@torch.no_grad()
def _measure(m: nn.Module, width: int, eps: float) -> tuple[str, bool, str | None]:
    """(kind, unit offset, reduction dtype) of a duck-typed norm, from two rows through its
    own forward (hooks bypassed, autocast off): an fp32 row with a non-zero mean matched
    against float64 LayerNorm / RMSNorm, each with gain ``w`` or ``1 + w``; and an fp16 row
    of ones holding one 300, whose sum of squares overflows an fp16 reduction."""
    w = m.weight.detach()
    b = getattr(m, "bias", None)
    b = b.detach().double() if isinstance(b, torch.Tensor) else None
    dev = w.device
    kind, offset, red = "unknown", False, None
    try:
        with _no_autocast(dev.type):
            x = torch.linspace(-1.0, 3.0, width, device=dev)[None]
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
    except Exception:  # a forward that cannot take a [1, D] row: kind stays unknown
        pass
    return kind, offset, red


def _found(name: str, m: nn.Module) -> FoundNorm | None:
    """A ``FoundNorm`` for a normalization module, None for anything else."""
    cls = type(m).__name__
    weight = getattr(m, "weight", None)
    bias = isinstance(getattr(m, "bias", None), torch.Tensor)
    refusal = ""
    if isinstance(m, Norm):
        return FoundNorm(name, cls, m.kind, m.eps, m.dim, bias, m.reduction_dtype, module=m)
    if type(m).forward in (nn.LayerNorm.forward, nn.RMSNorm.forward):  # torch's own forward
        kind = "layernorm" if isinstance(m, nn.LayerNorm) else "rmsnorm"
        shape = tuple(m.normalized_shape)
        # nn.RMSNorm's eps=None is finfo(input dtype).eps: fp32's for an fp32 model
        eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
        if len(shape) != 1:
            refusal = f"normalized_shape={list(shape)}: the zoo normalizes the last dimension only"
        return FoundNorm(
            name, cls, kind, float(eps), shape[-1], bias, "fp32", refusal=refusal, module=m
        )
    # a torch norm subclass with its own forward is measured like any other class
    torch_subclass = isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and isinstance(weight, torch.Tensor)
    if not (_is_duck_norm(m) or torch_subclass):
        return None
    eps = _eps_of(m)
    eps = float(torch.finfo(torch.float32).eps) if eps is None else eps  # nn.RMSNorm's None
    width = int(weight.shape[-1]) if weight.dim() else 0
    if cls in UPCASTING_RMSNORMS and hasattr(m, "variance_epsilon"):
        kind, offset, red = "rmsnorm", False, "fp32"
    else:
        kind, offset, red = _measure(m, width, eps) if width else ("unknown", False, None)
    offset = offset or bool(getattr(m, "add_unit_offset", False))
    if offset:
        refusal = "its gain is (1 + weight) (Gemma, litgpt add_unit_offset); the zoo's is weight"
    elif kind == "unknown":
        refusal = "it matches neither LayerNorm nor RMSNorm on a measured row"
    elif not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        refusal = "its weight is not a 1-D nn.Parameter"
    return FoundNorm(name, cls, kind, eps, width, bias, red, offset, refusal, module=m)


def find_norms(model: nn.Module) -> list[FoundNorm]:
    """Every normalization module of ``model``, in ``named_modules`` order (see module doc)."""
    found = (_found(name, m) for name, m in model.named_modules())
    return [f for f in found if f is not None]


def _targets(found: dict[str, FoundNorm], sites) -> dict[str, dict[str, Any]]:
    """{norm name: its overrides} for ``sites``: None (every found norm), names, or a
    mapping name -> {type, eps, reduction_dtype}."""
    if sites is None:
        return {n: {} for n in found}
    if isinstance(sites, str) or not isinstance(sites, (Mapping, Iterable)):
        raise TypeError(f"swap_norms: sites must be norm names or a dict, got {sites!r}")
    items = sites.items() if isinstance(sites, Mapping) else ((s, None) for s in sites)
    out = {}
    for name, kv in items:
        check_choice("swap_norms.sites", name, sorted(found))
        out[name] = dict(kv or {})
        for k in out[name]:
            check_choice(f"swap_norms.sites.{name}", k, SITE_KEYS)
    return out


def _check(key: str, type: str | None, eps: float | None, reduction_dtype: str) -> None:
    if type is not None:
        check_choice(f"{key}type", type, NORM_TYPES)
    if eps is not None:
        check_positive(f"{key}eps", eps)
    check_choice(f"{key}reduction_dtype", reduction_dtype, REDUCTION_DTYPES)


def _replacement(f: FoundNorm, kind: str, eps: float, red: str, backend: str) -> Norm:
    """The zoo ``Norm`` for ``f``, holding ``f``'s own weight and bias Parameters."""
    old = f.module
    spec = get_norm_type(kind)
    weight = getattr(old, "weight", None)
    bias = getattr(old, "bias", None) if f.bias else None
    where = f"swap_norms: {f.name} ({f.cls})"
    if weight is not None and tuple(weight.shape) != tuple(spec.weight_shape(f.width)):
        raise ValueError(
            f"{where} cannot become {kind}: its weight is {list(weight.shape)}, {kind}'s "
            f"would be {list(spec.weight_shape(f.width))}"
        )
    if bias is not None and not spec.has_bias:
        raise ValueError(f"{where} cannot become {kind}: it has a bias and {kind} has none")
    cfg = NormConfig(
        type=kind,
        eps=eps,
        affine=weight is not None,
        bias=bias is not None,
        reduction_dtype=red,
        backend=backend,
    )
    new = build_norm(f.width, cfg)
    new.weight = weight  # the same Parameter objects: the optimizer and state dict hold them
    new.bias = bias
    new.train(old.training)
    return new


def swap_norms(
    model: nn.Module,
    type: str | None = None,
    eps: float | None = None,
    reduction_dtype: str = "fp32",
    sites: Iterable[str] | Mapping[str, Mapping[str, Any]] | None = None,
    backend: str = "auto",
) -> list[str]:
    """Replace norms of ``model`` in place by the zoo's ``Norm``; returns their names.

    Every found norm, or only those named in ``sites`` (names, or name -> {type, eps,
    reduction_dtype} over the shared arguments). ``type`` defaults to each norm's own kind,
    ``eps`` to its own eps. Weight and bias are the same ``Parameter`` objects, so an
    optimizer built before the swap keeps training them and the state-dict keys do not
    change; placement is untouched; hooks on the old modules are lost. A norm that cannot be
    swapped (``FoundNorm.refusal``: a ``(1 + weight)`` gain, an unknown kind) is refused in
    one line, before anything is replaced.
    """
    _check("swap_norms.", type, eps, reduction_dtype)
    check_choice("swap_norms.backend", backend, BACKENDS)
    found = {f.name: f for f in find_norms(model)}
    plan = []
    for name, kv in _targets(found, sites).items():
        f = found[name]
        if f.refusal or not name:
            why = f.refusal or "it is the model itself"
            raise ValueError(f"swap_norms: {name or '<model>'} ({f.cls}) cannot be swapped: {why}")
        kind = kv.get("type", type)
        e = kv.get("eps", eps)
        red = kv.get("reduction_dtype", reduction_dtype)
        _check(f"swap_norms.sites.{name}.", kind, e, red)
        new = _replacement(f, kind or f.kind, f.eps if e is None else e, red, backend)
        plan.append((name, new))
    for name, new in plan:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return [name for name, _ in plan]
