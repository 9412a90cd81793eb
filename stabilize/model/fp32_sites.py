"""``model.fp32_modules``: modules whose forward runs in fp32 with autocast off
(docs/design-precision.md section 3).

A precision site is a place in the model where the compute dtype is chosen: under
``bf16-mixed`` / ``fp16-mixed`` autocast every matmul runs in 16 bits, a norm reduces in its
``reduction_dtype``; under ``bf16-true`` everything runs in bf16. Switching a site to the
reference's precision (fp32) means: the module's forward runs with autocast disabled on
fp32 inputs, a norm of ours also reduces in fp32, and an emulated rounding at its output
(``fault=biased_round``) is not applied. Under autocast its output stays fp32 (the next
module's autocast casts it as it would any input); under ``bf16-true`` its bf16 weights are
read as fp32 copies for the call and its output goes back to bf16. The sites of a model
(``sites``) are its norms, its linear layers (the head included) and our attention's
scores and softmax, in module order: what the gap bisection halves over. The run's other
sites (the loss, the optimizer's state and master weights, the gradient all-reduce) are not
modules: ``replay/gap_bisect.py`` ``RUN_SITES``.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

FLAG = "_stabilize_fp32"  # set on a switched module (the planted rounding reads it)


def is_fp32(module: nn.Module) -> bool:
    return bool(getattr(module, FLAG, False))


def _cast(x, dtype):
    """Floating tensors (alone or in a tuple / list) to ``dtype``; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


SIXTEEN = (torch.bfloat16, torch.float16)


def _fp32_forward(self, *args, **kwargs):
    """The class's forward with autocast off on fp32 inputs (bound to the module: a deep
    copy of the module binds it to the copy). 16-bit parameters (``bf16-true``) are read
    as fp32 copies for the call (the gradient flows back to them through the cast), and
    with no autocast around it (``bf16-true``) the output goes back to the input's 16-bit
    dtype, as the next module expects it."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    dev = first.device.type if first is not None else "cpu"
    back = None
    if first is not None and first.dtype in SIXTEEN and not torch.is_autocast_enabled(dev):
        back = first.dtype
    low = {n: p.float() for n, p in self.named_parameters() if p.dtype in SIXTEEN}
    params = _reparametrize_module(self, low) if low else contextlib.nullcontext()
    with torch.autocast(dev, enabled=False), params:
        out = type(self).forward(
            self,
            *_cast(args, torch.float32),
            **{k: _cast(v, torch.float32) for k, v in kwargs.items()},
        )
    return out if back is None else _cast(out, back)


def run_in_fp32(module: nn.Module) -> None:
    """``module``'s forward from now on: autocast off, floating inputs cast to fp32."""
    if is_fp32(module):
        return
    module.forward = types.MethodType(_fp32_forward, module)
    setattr(module, FLAG, True)
    if hasattr(module, "reduction_dtype"):  # our Norm: its explicit reduction too
        module.reduction_dtype = "fp32"


KINDS = ("Conv1D", "ScaledDotProduct")  # Hugging Face's GPT-2 linear; our attention's core


def sites(model: nn.Module) -> list[str]:
    """The model's precision sites: its norms (ours, or any module whose class name ends in
    ``Norm``), linear layers (``nn.Linear``, Hugging Face's ``Conv1D``) and our attention's
    scores and softmax (``ScaledDotProduct``), in module order."""
    out = []
    for name, m in model.named_modules():
        kind = type(m).__name__
        if name and (isinstance(m, nn.Linear) or kind in KINDS or kind.endswith("Norm")):
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
