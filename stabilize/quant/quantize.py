"""Fake quantization in plain torch: a tensor through one scheme, keeping what the counts need.

torchao quantizes too (``stabilize.quant.ao``), but its results hide what the harness counts:
after a saturating cast a clipped value is one more ``max``. ``quantize`` keeps the scaled
values *before* the cast, each scale group's amax and its scale, so that ``headroom`` can count
saturation, clipped blocks and underflow without a second pass. The arithmetic follows
torchao's reference paths operation for operation (the tests compare them bit for bit where
torchao runs on CPU), so the counts describe the numbers torchao's emulation trains on.

A *scheme* is how one GEMM operand is quantized; a *recipe* (the ``quant`` config names) picks
a scheme per operand role: ``input``, ``weight`` (the fprop GEMM; ``input`` is reused by the
wgrad GEMM) and ``grad_output`` (the dgrad and wgrad GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stabilize.quant import scaling
from stabilize.quant.formats import E4M3, E5M2, ElemFormat, cast, elem_format
from stabilize.validate import ConfigError, check_choice

KINDS = ("tensor", "rowwise", "delayed", "mx", "nvfp4")
BLOCK = {"mx": 32, "nvfp4": 16}  # elements per scale block along the last dim
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Scheme:
    """How one tensor is quantized: the scaling kind, the element format and its knobs."""

    kind: str
    elem: str = "e4m3"
    pow2: bool = False  # tensor / rowwise / delayed: round the scale down to a power of two
    scale_rounding: str = "rceil"  # mx: "floor" (OCP) or "rceil"
    sr: bool = False  # nvfp4: stochastic rounding (Transformer Engine rounds gradients so)
    tile: bool = False  # nvfp4: one block scale per 16 x 16 tile of a 2-d tensor (weights)

    def __post_init__(self) -> None:
        check_choice("quant.kind", self.kind, KINDS)
        fmt = elem_format(self.elem)
        if self.kind == "nvfp4" and fmt.name != "e2m1":
            raise ConfigError(f"quant.elem={self.elem!r} is not allowed; allowed: ['e2m1']")
        if self.kind in ("tensor", "rowwise", "delayed") and fmt.dtype is None:
            raise ConfigError(
                f"quant.elem={self.elem!r} is not allowed for {self.kind} scaling; "
                "allowed: ['e4m3', 'e5m2']"
            )
        check_choice("quant.scale_rounding", self.scale_rounding, scaling.SCALE_ROUNDINGS)
        if (self.sr or self.tile) and self.kind != "nvfp4":
            raise ConfigError(f"stochastic rounding and 16 x 16 tiles are not allowed with "
                              f"{self.kind} scaling; allowed: nvfp4")  # fmt: skip

    @property
    def fmt(self) -> ElemFormat:
        return elem_format(self.elem)

    @property
    def block(self) -> int | None:
        return BLOCK.get(self.kind)


@dataclass
class Quantized:
    """One tensor after ``quantize``; values laid out as [groups, group size], fp32.

    A group is what one scale covers: the whole tensor (tensor / delayed), a row (rowwise) or
    a block (mx: 32 elements, nvfp4: 16) along the last dim.
    """

    scheme: Scheme
    shape: torch.Size
    group_amax: torch.Tensor  # [G, 1]: each group's max |x| before scaling
    scale: torch.Tensor  # [G, 1] (or 0-d): encode scale (fp8 kinds) or decode scale (blocks)
    scaled: torch.Tensor  # [G, n]: x in the element format's units, before the cast
    q: torch.Tensor  # [G, n]: the cast (saturating) values, fp32

    @property
    def decode(self) -> bool:
        return self.scheme.block is not None

    def dequantize(self) -> torch.Tensor:
        """The tensor the quantized GEMM sees, fp32, in the input's shape."""
        out = self.q * self.scale if self.decode else self.q / self.scale
        if self.scheme.tile:
            return _untiled(out, self.shape)
        return out.reshape(self.shape)


TILE = 16  # nvfp4's 2-d blocks: 16 x 16; and the random Hadamard transform's size
RHT_SEED = 0  # the transform's random signs: one fixed vector, as a recipe fixes its own


def hadamard(n: int = TILE) -> torch.Tensor:
    """The n x n Hadamard matrix (Sylvester's construction, n a power of two), orthonormal:
    entries +-1 / sqrt(n)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def rht_signs(n: int = TILE) -> torch.Tensor:
    """The transform's fixed random +-1 diagonal."""
    g = torch.Generator().manual_seed(RHT_SEED)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def rht(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """A [N, C] tensor with every 16 consecutive rows mixed by ``H diag(signs)``, the random
    Hadamard transform Transformer Engine's NVFP4 recipe applies along the tokens of the
    wgrad GEMM's two operands: orthonormal, so ``rht(dy)^T rht(x) = dy^T x`` exactly, while a
    block's outlier is spread over its 16 rows before the 4-bit cast."""
    n, c = t.shape
    if n % TILE:
        raise ValueError(
            f"quant.nvfp4.rht needs the rows (tokens) of a micro-batch in blocks of 16; got "
            f"{n}; allowed: batch_size x block_size divisible by 16"
        )
    m = hadamard(TILE).to(t) * signs.to(t)[None, :]
    return torch.einsum("ij,bjc->bic", m, t.reshape(n // TILE, TILE, c)).reshape(n, c)


def _tiled(x: torch.Tensor) -> torch.Tensor:
    """A [R, C] tensor as [R C / 256, 256]: one row per 16 x 16 tile, tiles in row order."""
    r, c = x.shape
    if r % TILE or c % TILE:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} cannot be split into 16 x 16 nvfp4 tiles; "
            "allowed: both widths divisible by 16"
        )
    return x.reshape(r // TILE, TILE, c // TILE, TILE).transpose(1, 2).reshape(-1, TILE * TILE)


def _untiled(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    r, c = shape
    return t.reshape(r // TILE, c // TILE, TILE, TILE).transpose(1, 2).reshape(r, c)


def _grouped(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """``x`` as fp32 [groups, group size] for ``scheme`` (a view where the layout allows)."""
    x = x.detach().float()
    if scheme.kind in ("tensor", "delayed"):
        return x.reshape(1, -1)  # [1, numel]
    if scheme.tile:
        if x.dim() != 2:
            raise ValueError(f"16 x 16 nvfp4 tiles need a 2-d tensor, not {tuple(x.shape)}")
        return _tiled(x)
    k = x.shape[-1] if x.dim() else 1
    block = scheme.block
    if block is not None and k % block:
        raise ValueError(
            f"a tensor of shape {tuple(x.shape)} cannot be split into {scheme.kind} blocks "
            f"of {block} along its last dim; allowed: a last dim divisible by {block}"
        )
    return x.reshape(-1, block or k)  # rowwise: [rows, K]; blocks: [numel / block, block]


def quantize(x: torch.Tensor, scheme: Scheme, scale: torch.Tensor | None = None) -> Quantized:
    """Fake-quantize ``x`` under ``scheme``; ``scale`` is the delayed-scaling encode scale.

    Nothing leaves the device. ``x`` may be any float dtype; the work is in fp32, as
    torchao's paths upcast before scaling.
    """
    fmt = scheme.fmt
    g = _grouped(x, scheme)
    if scheme.kind == "delayed":
        if scale is None:
            raise ValueError(
                "quant.kind='delayed' needs the scale of its DelayedScaling state; "
                "allowed: quantize(x, scheme, scale=state.scale)"
            )
        a = scaling.amax(g, dim=-1)
        s = scale.detach().float().reshape(1, 1).clone()  # the state moves on after the cast
        s = scaling.round_down_pow2(s) if scheme.pow2 else s
        scaled = g * s
    elif scheme.kind in ("tensor", "rowwise"):
        a = scaling.amax(g, dim=-1)  # [1, 1] or [rows, 1]
        s = scaling.current_scale(a, fmt, pow2=scheme.pow2)
        scaled = g * s
    elif scheme.kind == "mx":
        a = scaling.amax(g, dim=-1)  # [blocks, 1]
        s = torch.exp2(scaling.mx_exponent(a, fmt, scheme.scale_rounding))
        scaled = g / s
    else:  # nvfp4: fp32 tensor scale x E4M3 block scale, applied as torchao does
        a = scaling.amax(g, dim=-1)  # [blocks, 1]
        ts = scaling.nvfp4_tensor_scale(a.amax())
        bs = scaling.nvfp4_block_scale(a, ts)
        scaled = g * ((1.0 / ts) / bs)
        s = ts * bs
    return Quantized(scheme, x.shape, a, s, scaled, cast(scaled, fmt, stochastic=scheme.sr))


# ---- the recipes: the quant config group's names, a scheme per operand role ---------------

RECIPES = ("none", "fp8_tensor", "fp8_rowwise", "fp8_delayed", "mxfp8", "nvfp4")


def scheme_for(
    recipe: str, role: str, *, scale_rounding: str = "rceil", sr: bool = False,
    weights_2d: bool = False,
) -> Scheme | None:  # fmt: skip
    """The scheme ``recipe`` uses for a GEMM operand in ``role``; None for ``none``.

    - fp8_tensor: torchao's tensorwise recipe, E4M3 forward, E5M2 gradients.
    - fp8_rowwise: torchao's rowwise recipe, E4M3 everywhere, power-of-two scales.
    - fp8_delayed: Transformer Engine's DelayedScaling with its HYBRID format (E4M3 forward,
      E5M2 gradients); the history, margin and amax algorithm live in ``DelayedScaling``.
    - mxfp8: E4M3 everywhere, one E8M0 scale per 32 elements, ``scale_rounding``.
    - nvfp4: E2M1 everywhere, 16-element blocks, E4M3 block scale x fp32 tensor scale;
      ``sr``: the gradients rounded stochastically, ``weights_2d``: the weight's blocks 16 x
      16 tiles (Transformer Engine's recipe does both).
    """
    check_choice("quant", recipe, RECIPES)
    check_choice("quant.role", role, ROLES)
    grad = role == "grad_output"
    if recipe == "none":
        return None
    if recipe == "fp8_tensor":
        return Scheme("tensor", E5M2.name if grad else E4M3.name)
    if recipe == "fp8_rowwise":
        return Scheme("rowwise", E4M3.name, pow2=True)
    if recipe == "fp8_delayed":
        return Scheme("delayed", E5M2.name if grad else E4M3.name)
    if recipe == "mxfp8":
        return Scheme("mx", E4M3.name, scale_rounding=scale_rounding)
    return Scheme("nvfp4", "e2m1", sr=sr and grad, tile=weights_2d and role == "weight")
