"""``QuantLinear``: an ``nn.Linear`` whose GEMM operands are quantized under one recipe, for
what torchao does not train on CPU: ``fp8_delayed`` (Transformer Engine's delayed scaling,
which torchao removed), ``mxfp8`` and ``nvfp4``.

Emulation, as torchao's ``emulate=True``: each operand is quantized and dequantized
(``quantize.quantize``, the counts' own code path), and the matmul runs in high precision
on what the 8- or 4-bit GEMM would see:

- forward: fprop's input ``x`` and weight ``w``;
- backward: the grad-output ``dy`` (dgrad ``dy @ w`` and wgrad ``dy^T x`` both use it, with
  the quantized ``x`` and ``w`` saved by the forward); with ``quant.nvfp4.rht`` the wgrad
  GEMM has operands of its own, as Transformer Engine's NVFP4 recipe lays them out: ``dy``
  and ``x`` mixed along the tokens by a random Hadamard transform (``quantize.rht``) and
  quantized in blocks of 16 tokens (the GEMM's reduction dim), not of 16 features; the
  probe counts them as the operands ``wx`` and ``wdy``.

Delayed scaling keeps, per operand, an amax history and the scale the next step's cast uses
(``scaling.delayed_scale``) as *buffers*: they are in the module's ``state_dict``, so a
snapshot, a rollback and a checkpoint carry them. A forward records its amax after its cast
(the scale it used came from earlier steps only: a tensor that grows faster than its
history saturates). A module given an ``on_quantized(operand, quantized, x)`` callback (the
probe's, stability/quant_sites.py) hands it each operand as cast, so the counts read the
very scale the GEMM used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stabilize.quant.quantize import (
    ROLES,
    Quantized,
    Scheme,
    quantize,
    rht,
    rht_signs,
    scheme_for,
)
from stabilize.quant.scaling import AMAX_ALGOS, delayed_scale
from stabilize.validate import ConfigError, check_choice

OWN_RECIPES = ("fp8_delayed", "mxfp8", "nvfp4")  # the recipes QuantLinear trains


class QuantLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: str, scale_rounding: str = "rceil", history: int = 1024,
                 margin: int = 0, amax_algo: str = "max", sr: bool = False,
                 weights_2d: bool = False, rht: bool = False, device=None,
                 dtype=None):  # fmt: skip
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        check_choice("quant", recipe, OWN_RECIPES)
        check_choice("quant.amax_algo", amax_algo, AMAX_ALGOS)
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ConfigError(f"quant.history={history!r} is not allowed; allowed: an int >= 1")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ConfigError(f"quant.margin={margin!r} is not allowed; allowed: an int >= 0")
        self.recipe, self.margin, self.amax_algo = recipe, margin, amax_algo
        self.nvfp4 = {"sr": sr, "weights_2d": weights_2d}  # nvfp4's own knobs (else refused)
        self.rht = rht
        if rht:  # the wgrad GEMM's transform: its signs a buffer (checkpoints carry them)
            if recipe != "nvfp4":
                raise ConfigError(f"quant.nvfp4.rht=true is not allowed with quant={recipe}; "
                                  "allowed: quant=nvfp4")  # fmt: skip
            self.register_buffer("rht_signs", rht_signs().to(device))
        self.schemes: tuple[Scheme, ...] = tuple(
            scheme_for(recipe, r, scale_rounding=scale_rounding, **self.nvfp4) for r in ROLES
        )
        if recipe == "fp8_delayed":  # oldest -> newest, per operand (x, w, dy)
            self.register_buffer("amax_history", torch.zeros(3, history, device=device))
            self.register_buffer("scale", torch.ones(3, device=device))  # TE starts at 1
        self.on_quantized = None  # the probe's callback, or None
        self.high_precision = False  # a remedy's: the GEMM in the input's precision
        self.scale_rounding = scale_rounding

    # ---- what the remedies change (module attributes: rollback/quant_remedies.py re-applies
    # them after a checkpoint load) -----------------------------------------------------------
    @property
    def delayed(self) -> bool:
        return self.schemes[0].kind == "delayed"

    def widen(self, by: int = 1) -> None:
        """Delayed scaling's margin ``by`` powers of two wider, the scales the next casts
        use taken again from the history with it (not only from the next step on)."""
        self.margin += by
        with torch.no_grad():
            for i, scheme in enumerate(self.schemes):
                hist = self.amax_history[i]
                if bool((hist > 0).any()):
                    self.scale[i] = delayed_scale(hist, scheme.fmt, margin=self.margin,
                                                  algo=self.amax_algo)  # fmt: skip

    def to_current(self) -> None:
        """Delayed scaling -> current scaling (each tensor's own amax), the same formats."""
        self.schemes = tuple(scheme_for("fp8_tensor", r) for r in ROLES)

    def to_rceil(self) -> None:
        """MX block scales rounded up (RCEIL) instead of down (FLOOR)."""
        self.scale_rounding = "rceil"
        self.schemes = tuple(
            scheme_for(self.recipe, r, scale_rounding="rceil", **self.nvfp4) for r in ROLES
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"

    def fake(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Operand ``i`` (0 x, 1 w, 2 dy) as the quantized GEMM sees it, in ``t``'s dtype."""
        if self.high_precision:
            return t
        delayed = self.delayed
        with torch.no_grad():
            qz: Quantized = quantize(t, self.schemes[i], self.scale[i] if delayed else None)
            if delayed and self.training:
                self._record(i, qz.group_amax.amax())
            if self.on_quantized is not None:
                self.on_quantized(i, qz, t)
            return qz.dequantize().to(t.dtype)

    def _record(self, i: int, amax: torch.Tensor) -> None:
        """This step's amax into operand i's history; the next step's scale from it."""
        h = self.amax_history[i]
        h.copy_(torch.cat([h[1:], amax.float().reshape(1)]))
        fmt = self.schemes[i].fmt
        self.scale[i] = delayed_scale(h, fmt, margin=self.margin, algo=self.amax_algo,
                                      previous=self.scale[i])  # fmt: skip

    def wgrad_operand(self, t: torch.Tensor, grad: bool) -> torch.Tensor:
        """A wgrad operand under ``rht``: [tokens, C] -> transformed along the tokens,
        quantized in blocks of 16 tokens, returned [C, tokens] (the GEMM's layout); handed
        to the probe as operand 3 (``wx``) or 4 (``wdy``)."""
        scheme = Scheme("nvfp4", "e2m1", sr=grad and self.nvfp4["sr"])
        with torch.no_grad():
            mixed = rht(t.float(), self.rht_signs).t().contiguous()
            qz = quantize(mixed, scheme)
            if self.on_quantized is not None:
                self.on_quantized(4 if grad else 3, qz, mixed)
            return qz.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantMatmul.apply(x, self.weight, self.bias, self)


class _QuantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, mod: QuantLinear):
        xq, wq = mod.fake(0, x), mod.fake(1, w).to(x.dtype)
        wgrad_own = mod.rht and not mod.high_precision  # the wgrad GEMM's own operands
        ctx.save_for_backward(x if wgrad_own else xq, wq)
        ctx.mod, ctx.has_bias, ctx.wgrad_own = mod, b is not None, wgrad_own
        return F.linear(xq, wq, b.to(x.dtype) if b is not None else None)

    @staticmethod
    def backward(ctx, dy):
        xs, wq = ctx.saved_tensors
        mod = ctx.mod
        dyq = mod.fake(2, dy)
        dx = dyq @ wq.to(dy.dtype)
        if ctx.wgrad_own:  # x saved in high precision: both operands laid out for wgrad
            g = mod.wgrad_operand(dy.reshape(-1, dy.shape[-1]), grad=True)  # [out, N]
            xt = mod.wgrad_operand(xs.reshape(-1, xs.shape[-1]), grad=False)  # [in, N]
            dw = (g @ xt.t()).to(dy.dtype)
        else:
            flat = dyq.reshape(-1, dyq.shape[-1])
            dw = flat.t() @ xs.reshape(-1, xs.shape[-1]).to(dy.dtype)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dx, dw, db, None


def check_widths(model: nn.Module, names: list[str], recipe: str) -> None:
    """A block format's operands must split into its blocks along both widths (the input
    and weight along ``in_features``, the grad-output along ``out_features``)."""
    from stabilize.quant.quantize import BLOCK

    block = BLOCK.get(scheme_for(recipe, "input").kind) if recipe in OWN_RECIPES else None
    for name in names:
        m = model.get_submodule(name)
        if block and (m.in_features % block or m.out_features % block):
            raise ConfigError(
                f"quant.layers includes {name} ({m.in_features} -> {m.out_features}), whose "
                f"widths do not split into {recipe}'s blocks of {block}; allowed: Linears "
                f"with both widths divisible by {block} (exclude it with quant.exclude)"
            )


def swap_linears(model: nn.Module, names: list[str], recipe: str, **knobs) -> list[str]:
    """Swap the named ``nn.Linear`` modules for ``QuantLinear`` in place, the same weight
    and bias ``Parameter`` objects kept (an optimizer built before holds them); their names.
    A block format's operands must split into its blocks: a Linear whose widths do not is
    refused in one line, nothing swapped."""
    check_widths(model, names, recipe)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        new = QuantLinear(old.in_features, old.out_features, old.bias is not None,
                          recipe=recipe, device=old.weight.device, **knobs)  # fmt: skip
        new.weight = old.weight
        new.bias = old.bias
        new.train(old.training)
        setattr(parent, attr, new)
    return list(names)
