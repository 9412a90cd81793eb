"""The rungs for a quantized GEMM that clips (``quant=...``, stabilize/quant/): each changes
one thing about the Linears the fault names or about the recipe, says in ``unchanged`` why
it would change nothing (the policy then passes it over), and is re-applied after a
checkpoint load (a module attribute is in no state dict).

- ``quant_bf16``: the Linears the verdict names (``state.fault_sites``) run their GEMM in the
  input's precision from now on (``state.high_precision``, saved): the layer the counts
  name, as real recipes keep some layers in bf16;
- ``quant_margin``: delayed scaling's margin one power of two wider (the scale is
  ``max / (amax * 2**margin)``): headroom for a tensor that grows faster than its history;
- ``quant_current``: delayed scaling replaced by current scaling (each tensor's own amax);
- ``quant_rceil``: MX block scales rounded up (RCEIL), which never clips a block's largest
  value, instead of down (FLOOR, OCP's rule), which clips those whose amax has a mantissa
  above 1.75.

They answer the ``quant`` monitor's verdicts first (``sites``). For a torchao
``Float8Linear`` (current scaling already) only ``quant_bf16`` can change something: the
module is swapped back for an ``nn.Linear`` holding the same parameters.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stabilize.quant.linear import QuantLinear
from stabilize.rollback.remedies import Remedy, register_remedy
from stabilize.rollback.state import TrainState


def _quantized(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear of ``model`` whose GEMM runs quantized now, by name."""
    out = {}
    for name, m in model.named_modules():
        if (
            isinstance(m, QuantLinear)
            and not m.high_precision
            or type(m).__name__ == "Float8Linear"
        ):
            out[name] = m
    return out


def _to_high_precision(model: nn.Module, name: str, m: nn.Module) -> None:
    if isinstance(m, QuantLinear):
        m.high_precision = True
        return
    plain = nn.Linear(m.in_features, m.out_features, m.bias is not None, device="meta")
    plain.weight, plain.bias = m.weight, m.bias  # the optimizer's parameters, kept
    plain.train(m.training)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, plain)


class QuantBF16(Remedy):
    name = "quant_bf16"
    sites = ("quant",)

    def unchanged(self, state: TrainState, cfg: None) -> str | None:
        live = _quantized(state.model)
        todo = [s for s in state.fault_sites if s in live]
        return None if todo else "no named quantized Linear left to run in high precision"

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        live = _quantized(state.model)
        done = [s for s in state.fault_sites if s in live]
        for s in done:
            _to_high_precision(state.model, s, live[s])
        state.high_precision = sorted({*state.high_precision, *done})
        return {"high_precision": done}

    def reapply(self, state: TrainState, cfg: None, times: int) -> None:
        live = _quantized(state.model)
        for s in state.high_precision:
            if s in live:
                _to_high_precision(state.model, s, live[s])


def _delayed(model: nn.Module) -> list[QuantLinear]:
    return [m for m in _quantized(model).values() if isinstance(m, QuantLinear) and m.delayed]


class QuantMargin(Remedy):
    name = "quant_margin"
    sites = ("quant",)

    def unchanged(self, state: TrainState, cfg: None) -> str | None:
        return None if _delayed(state.model) else "no Linear uses delayed scaling"

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        layers = _delayed(state.model)
        for m in layers:
            m.widen(1)
        return {"margin": layers[0].margin, "layers": len(layers)}

    def reapply(self, state: TrainState, cfg: None, times: int) -> None:
        for m in _delayed(state.model):
            m.widen(times)


class _EachLayer(Remedy):
    """A rung that changes every Linear ``select`` gives, the same way (``change``)."""

    sites = ("quant",)
    none_left = ""  # why it would change nothing, when ``select`` gives none
    key = ""  # its count's name in the rollback event

    def select(self, model: nn.Module) -> list[QuantLinear]:
        raise NotImplementedError

    def change(self, m: QuantLinear) -> None:
        raise NotImplementedError

    def unchanged(self, state: TrainState, cfg: None) -> str | None:
        return None if self.select(state.model) else self.none_left

    def apply(self, state: TrainState, cfg: None) -> dict[str, Any]:
        layers = self.select(state.model)
        for m in layers:
            self.change(m)
        return {self.key: len(layers)}

    def reapply(self, state: TrainState, cfg: None, times: int) -> None:
        for m in self.select(state.model):
            self.change(m)


class QuantCurrent(_EachLayer):
    name, key, none_left = "quant_current", "current_scaling", "no Linear uses delayed scaling"

    def select(self, model: nn.Module) -> list[QuantLinear]:
        return _delayed(model)

    def change(self, m: QuantLinear) -> None:
        m.to_current()


def _floor(model: nn.Module) -> list[QuantLinear]:
    return [m for m in _quantized(model).values()
            if isinstance(m, QuantLinear) and m.schemes[0].kind == "mx"
            and m.scale_rounding == "floor"]  # fmt: skip


class QuantRceil(_EachLayer):
    name, key, none_left = "quant_rceil", "rceil", "no MX block scale is rounded down (FLOOR)"

    def select(self, model: nn.Module) -> list[QuantLinear]:
        return _floor(model)

    def change(self, m: QuantLinear) -> None:
        m.to_rceil()


QUANT_RUNGS = ("quant_rceil", "quant_margin", "quant_current", "quant_bf16")
for _remedy in (QuantRceil(), QuantMargin(), QuantCurrent(), QuantBF16()):
    register_remedy(_remedy)
