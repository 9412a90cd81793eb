"""The 8- and 4-bit element formats and the E8M0 block scale, as facts and as casts.

Three element formats (OCP 8-bit FP spec, OCP MX v1.0 spec for E2M1):

- **E4M3** (``float8_e4m3fn``): max 448, no inf; the all-ones pattern is NaN. torch's CPU
  cast *saturates* (480, 1e4 and inf all become 448), so a count of saturation has to be taken
  on the scaled values before the cast: afterwards a clipped value looks like any other 448.
- **E5M2** (``float8_e5m2``): max 57344, has inf; the cast rounds to inf from 61440 on.
- **E2M1** (FP4): the 15 values 0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6; no inf, no NaN.
  torch has no arithmetic for it, so the cast is written here (round to nearest, ties to even).

A format's ``overflow_from`` is where a cast *without* saturation would leave the finite range:
half an ulp above ``max``, the tie going up when ``max``'s last mantissa bit is odd (E5M2:
57344 + 4096 = 61440 becomes inf; E4M3: 464 rounds down to 448, only values above it overflow).
The harness calls a value *saturated* when it lies past that point: one that rounds to ``max``
anyway has lost no more than rounding costs everywhere else, a fp32 rounding of ``amax *
(448 / amax)`` to 448.00003 included.

**E8M0** is the MX block scale: 8 exponent bits, no mantissa, no sign, no zero. It stores the
powers of two 2^-127 .. 2^127 (code = exponent + 127, codes 0..254); code 255 is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from stabilize.validate import ConfigError


@dataclass(frozen=True)
class ElemFormat:
    """One element format: its limits, and how the harness rounds to it."""

    name: str
    max: float  # largest finite magnitude
    mbits: int  # explicit mantissa bits
    min_normal: float
    min_subnormal: float
    has_inf: bool
    dtype: torch.dtype | None  # torch's own dtype where torch can cast to it
    values: tuple[float, ...] = field(default=(), repr=False)  # every magnitude, when few

    @property
    def emax(self) -> int:
        """floor(log2(max)): the exponent of the largest binade (8 for E4M3, 15 for E5M2)."""
        return math.frexp(self.max)[1] - 1

    @property
    def overflow_from(self) -> float:
        """Half an ulp above ``max``: where an unsaturated cast leaves the finite range."""
        return self.max + 2.0 ** (self.emax - self.mbits) / 2

    @property
    def overflow_tie_up(self) -> bool:
        """Whether a value exactly at ``overflow_from`` overflows (``max``'s last bit is odd)."""
        return int(self.max / 2.0 ** (self.emax - self.mbits)) % 2 == 1


E4M3 = ElemFormat(
    name="e4m3",
    max=448.0,
    mbits=3,
    min_normal=2.0**-6,
    min_subnormal=2.0**-9,
    has_inf=False,
    dtype=torch.float8_e4m3fn,
)
E5M2 = ElemFormat(
    name="e5m2",
    max=57344.0,
    mbits=2,
    min_normal=2.0**-14,
    min_subnormal=2.0**-16,
    has_inf=True,
    dtype=torch.float8_e5m2,
)
E2M1 = ElemFormat(
    name="e2m1",
    max=6.0,
    mbits=1,
    min_normal=1.0,
    min_subnormal=0.5,
    has_inf=False,
    dtype=None,
    values=(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
)
FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E4M3, E5M2, E2M1)}


def elem_format(name: str, key: str = "quant.elem") -> ElemFormat:
    """The format called ``name``; a ConfigError naming the key and the allowed names."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"{key}={name!r} is not a known element format; allowed: {sorted(FORMATS)}"
        ) from None


def e2m1_values() -> list[float]:
    """E2M1's 15 distinct values, ascending (+0 and -0 are one value)."""
    mags = list(E2M1.values)
    return sorted({-v for v in mags} | set(mags))


def _cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to E2M1 (saturating at 6), returned as fp32.

    E2M1's magnitudes are spaced 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; rounding to a
    multiple of the spacing with ``torch.round`` (ties to even) rounds to nearest, ties to the
    even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    No lookup table, so nothing is copied to the device.
    """
    mag = x.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    out = (torch.round(mag / step) * step).clamp(max=E2M1.max)
    return torch.copysign(out, x)  # NaN stays NaN (E2M1 itself has none)


def _cast_e2m1_stochastic(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` (already within +-6) to one of its two E2M1 neighbours at random,
    the upper with probability (|x| - lower) / (upper - lower): unbiased, E[q] = x, where
    round-to-nearest takes every value in (0.25, 0.75) to 0.5. A value on the grid stays.
    The draw is torch's global generator's (as dropout's), so a checkpoint's RNG state
    replays it."""
    mag = x.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    low = torch.floor(mag / step) * step
    up = (torch.rand_like(mag) < (mag - low) / step).float()
    return torch.copysign((low + up * step).clamp(max=E2M1.max), x)


def cast(
    x: torch.Tensor, fmt: ElemFormat, *, saturate: bool = True, stochastic: bool = False
) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return it as fp32 (a fake quantization of the elements).

    ``saturate=True`` clamps to +-max first, as torchao and Transformer Engine do, so the
    result does not depend on whether this torch's cast saturates. ``saturate=False`` shows
    the format's own behaviour (E5M2: inf from 61440; torch's E4M3 cast saturates anyway).
    ``stochastic``: E2M1 only, rounded at random between its two neighbours (unbiased), as
    Transformer Engine's NVFP4 recipe rounds gradients.
    """
    x = x.float()
    if saturate:
        x = x.clamp(-fmt.max, fmt.max)
    if stochastic:
        if fmt.dtype is not None:
            raise ValueError(f"stochastic rounding is for E2M1 (NVFP4), not {fmt.name}")
        return _cast_e2m1_stochastic(x)
    if fmt.dtype is None:
        return _cast_e2m1(x)
    return x.to(fmt.dtype).float()


def overflows(scaled_abs: torch.Tensor, fmt: ElemFormat) -> torch.Tensor:
    """Mask of magnitudes (already scaled into ``fmt``'s units) that saturation changes."""
    edge = fmt.overflow_from
    if fmt.overflow_tie_up:
        return scaled_abs >= edge
    return scaled_abs > edge


# ---- E8M0: the power-of-two block scale of the MX formats --------------------------------

E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN = 255


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Unbiased integer exponents -> E8M0 codes (uint8), clamped to 2^-127..2^127.

    A NaN exponent (a float tensor holding NaN, from a NaN amax) gives code 255.
    """
    nan = torch.isnan(exponent) if exponent.is_floating_point() else None
    e = torch.nan_to_num(exponent.float(), nan=0.0).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    code = (e + E8M0_BIAS).to(torch.uint8)
    if nan is not None:
        code = torch.where(nan, torch.full_like(code, E8M0_NAN), code)
    return code


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> fp32 scales 2^(code - 127); code 255 -> NaN."""
    c = code.to(torch.int32)
    scale = torch.exp2((c - E8M0_BIAS).float())
    return torch.where(c == E8M0_NAN, torch.full_like(scale, float("nan")), scale)
