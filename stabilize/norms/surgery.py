"""Norm discovery and surgery on a model we did not build (docs/design-your-model.md
sections 4-5).

- ``find_norms(model)``: every normalization module, by type (``nn.LayerNorm``,
  ``nn.RMSNorm``, our ``Norm``, Hugging Face's ``LlamaRMSNorm`` matched by class name), by
  duck typing (a class name ending in ``Norm`` with a ``weight`` and an ``eps`` or
  ``variance_epsilon``), and by measurement (a leaf holding only a 1-D ``weight`` and bias
  that normalizes its input's last dimension on measured rows: nanoGPT's ``LayerNorm``, eps
  kept inside ``forward``, whose eps is then measured too). For a class it does not know, its
  kind (layernorm / rmsnorm, with or without a ``(1 + weight)`` gain) and the dtype its
  reduction really runs in are *measured* (``measure.py``), not guessed from its name.
- ``swap_norms(model, ...)``: replace found norms by the zoo's ``Norm`` of the same kind (or
  another), handing it the *same* ``nn.Parameter`` objects, so an optimizer built before the
  swap still holds them and the state-dict keys do not change. Where nothing was swapped, or
  norms are computed inline (``F.layer_norm`` in a block's ``forward``: no module to swap),
  it warns in one line.

No ``transformers`` import: its classes are recognised by name and attributes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stabilize.norms.backends import BACKENDS
from stabilize.norms.config import REDUCTION_DTYPES, NormConfig
from stabilize.norms.measure import (
    DEFAULT_EPS,
    affine_leaf,
    inline_line,
    inline_norms,
    measure,
    recover_eps,
)
from stabilize.norms.module import Norm, build_norm
from stabilize.norms.registry import NORM_TYPES, get_norm_type
from stabilize.validate import check_choice, check_positive

# What ``sites={name: {...}}`` may set per norm, over the shared arguments.
SITE_KEYS = ("type", "eps", "reduction_dtype")
# Known classes that upcast to fp32 before the mean of squares (matched by class name).
UPCASTING_RMSNORMS = ("LlamaRMSNorm",)


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
    eps_from: str = "attribute"
    """Where ``eps`` came from: ``attribute`` (``eps`` / ``variance_epsilon``), ``measured``
    (a class that keeps it inside ``forward``), or ``default`` (1e-5: it could not be
    measured)."""
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
    named = _is_duck_norm(m) or torch_subclass
    if not (named or affine_leaf(m)):
        return None
    eps, eps_from = _eps_of(m), "attribute"
    if eps is None and torch_subclass:
        eps = float(torch.finfo(torch.float32).eps)  # nn.RMSNorm's None
    width = int(weight.shape[-1]) if weight.dim() else 0
    if cls in UPCASTING_RMSNORMS and hasattr(m, "variance_epsilon"):
        kind, offset, red = "rmsnorm", False, "fp32"
    else:
        guess = DEFAULT_EPS if eps is None else eps  # the kind's match tolerates eps's size
        kind, offset, red = measure(m, width, guess) if width else ("unknown", False, None)
    if not named and kind == "unknown":
        return None  # a leaf with a weight that does not normalize: not a norm
    if eps is None:  # kept inside forward (nanoGPT's LayerNorm): measured
        eps = recover_eps(m, kind, offset, width) if kind != "unknown" else None
        eps, eps_from = (eps, "measured") if eps is not None else (DEFAULT_EPS, "default")
    offset = offset or bool(getattr(m, "add_unit_offset", False))
    if offset:
        refusal = "its gain is (1 + weight) (Gemma, litgpt add_unit_offset); the zoo's is weight"
    elif kind == "unknown":
        refusal = "it matches neither LayerNorm nor RMSNorm on a measured row"
    elif not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        refusal = "its weight is not a 1-D nn.Parameter"
    return FoundNorm(name, cls, kind, eps, width, bias, red, offset, refusal, eps_from, module=m)


def find_norms(model: nn.Module) -> list[FoundNorm]:
    """Every normalization module of ``model``, in ``named_modules`` order (see module doc)."""
    found = (_found(name, m) for name, m in model.named_modules())
    return [f for f in found if f is not None]


def unseen_norms_line(model: nn.Module, found: Iterable[FoundNorm] | None = None) -> str:
    """One line naming the norms ``model`` computes inline (``F.layer_norm`` / ``F.rms_norm``
    inside a module's ``forward``), which no module holds: neither probed nor swappable.
    '' when there are none. ``found``: ``find_norms(model)``'s list, if already made."""
    seen = {f.name for f in (find_norms(model) if found is None else found)}
    return inline_line(inline_norms(model, seen))


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
    # never silent: a run that asked for a reduction dtype and got none of it says so
    unseen = unseen_norms_line(model, found.values())
    if not plan:
        why = unseen or "no module normalizes its input's last dimension"
        warnings.warn(
            f"swap_norms: nothing swapped in {model.__class__.__name__}: {why}", stacklevel=2
        )
    elif unseen:
        warnings.warn(f"swap_norms: {unseen}", stacklevel=2)
    return [name for name, _ in plan]
