"""Floating-point facts the harness reasons with: dtype names, limits and fp16 headroom.

Everything here is derived from ``torch.finfo`` rather than typed in, so the numbers in
logs, errors and reports are the ones PyTorch itself uses.

The one fact the product is built around: fp16's largest finite value is 65504, so a
single square overflows as soon as |x| > sqrt(65504) ~= 255.94 ("the 256 line"). A norm
that *sums* D squares in fp16 overflows earlier, when sum(x^2) > 65504, i.e. when the
root-mean-square of the row exceeds 255.94 / sqrt(D) (about 5.66 for D = 2048).
"""

from __future__ import annotations

import math

import torch

# Config names -> dtypes. "input" (a reduction in whatever dtype arrives) is resolved by
# the caller, so it is not in this table.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
_NAMES = {v: k for k, v in DTYPES.items()}

FP16_MAX = torch.finfo(torch.float16).max  # 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max  # ~3.39e38, fp32's exponent range
# |x| above which x*x is inf in fp16: 255.9375 is the largest fp16 value whose square is finite.
FP16_SQUARE_LIMIT = math.sqrt(FP16_MAX)  # 255.937...
# The round number the monitors and docs use for the danger line.
DANGER_LINE = 256.0


def dtype_from_name(name: str, key: str = "dtype") -> torch.dtype:
    """Map a config name ("fp32", "bf16", "fp16", "fp64") to a torch dtype.

    Raises ValueError naming the key, the bad value and the allowed values.
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"{key}={name!r} is not a known dtype; allowed: {sorted(DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The short config name of a dtype ("fp16"), or its torch name for others."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def is_low_precision(dtype: torch.dtype) -> bool:
    """True for the 16-bit float types whose reductions the harness must watch."""
    return dtype in (torch.float16, torch.bfloat16)


def max_finite(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def relative_spacing(dtype: torch.dtype) -> float:
    """Gap between 1 and the next representable value (2^-10 for fp16, 2^-7 for bf16).

    Round-to-nearest then has a worst-case relative error of half of this: 2^-8 for bf16.
    """
    return float(torch.finfo(dtype).eps)


def square_limit(dtype: torch.dtype) -> float:
    """Largest |x| whose square is still finite in ``dtype``."""
    return math.sqrt(max_finite(dtype))


def sum_of_squares_rms_limit(dtype: torch.dtype, dim: int) -> float:
    """Row RMS above which sum(x_i^2) over ``dim`` elements overflows in ``dtype``.

    sum(x^2) = D * rms^2 <= max  <=>  rms <= sqrt(max / D) = square_limit / sqrt(D).
    """
    if dim <= 0:
        raise ValueError(f"dim={dim!r} must be a positive integer")
    return square_limit(dtype) / math.sqrt(dim)


def headroom(abs_max: float, dtype: torch.dtype = torch.float16) -> float:
    """How many times |x| can still grow before its square overflows (<1 means overflowed)."""
    if abs_max <= 0:
        return math.inf
    return square_limit(dtype) / abs_max
