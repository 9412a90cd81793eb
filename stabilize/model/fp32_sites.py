"""``model.fp32_modules``: modules whose forward runs in fp32 with autocast off (issue 37;
docs/design-precision.md section 3).

A precision site is a place in the model where the compute dtype is chosen: under
``bf16-mixed`` / ``fp16-mixed`` autocast every matmul runs in 16 bits, a norm reduces in its
``reduction_dtype``. Switching a site to the reference's precision (fp32) means: the
module's forward runs with autocast disabled on fp32 inputs (its output is fp32; the next
module's autocast casts it as it would any input), a norm of ours also reduces in fp32, and
an emulated rounding at its output (``fault=biased_round``) is not applied. The sites of a
model (``sites``) are its norms and its linear layers (the head included), in module order:
what the gap bisection halves over. Parameters stay as they are: under ``bf16-true`` (bf16
weights) a switch is refused, since an fp32 forward needs fp32 weights.
"""

from __future__ import annotations

import types

import torch
from torch import nn

FLAG = "_stabilize_fp32"  # set on a switched module (the planted rounding reads it)


def is_fp32(module: nn.Module) -> bool:
    return bool(getattr(module, FLAG, False))


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _fp32_forward(self, *args, **kwargs):
    """The class's forward with autocast off on fp32 inputs (bound to the module: a deep
    copy of the module binds it to the copy)."""
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(dev, enabled=False):
        return type(self).forward(
            self, *map(_fp32, args), **{k: _fp32(v) for k, v in kwargs.items()}
        )


def run_in_fp32(module: nn.Module) -> None:
    """``module``'s forward from now on: autocast off, floating inputs cast to fp32."""
    if is_fp32(module):
        return
    module.forward = types.MethodType(_fp32_forward, module)
    setattr(module, FLAG, True)
    if hasattr(module, "reduction_dtype"):  # our Norm: its explicit reduction too
        module.reduction_dtype = "fp32"


def sites(model: nn.Module) -> list[str]:
    """The model's precision sites: its norms (ours, or any module whose class name ends in
    ``Norm``) and linear layers (``nn.Linear``, Hugging Face's ``Conv1D``), in order."""
    out = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if name and (isinstance(m, nn.Linear) or kind == "Conv1D" or kind.endswith("Norm")):
            out.append(name)
    return out


def apply_fp32_modules(model: nn.Module, paths) -> None:
    """Switch each named module to fp32 (a name that is not a module is refused, with the
    model's sites)."""
    names = dict(model.named_modules())
    for path in paths:
        if path not in names or not path:
            allowed = sites(model)
            more = " ..." if len(allowed) > 12 else ""
            raise ValueError(f"model.fp32_modules: {path!r} is not allowed: not a module of the "
                             f"model; its sites: {allowed[:12]}{more}")  # fmt: skip
        run_in_fp32(names[path])
