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

FP16_MAX = torch.finfo(torch.float16).max  # 65504.0
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


def max_finite(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


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
