"""Scales: how a tensor is brought into an element format's range, for each recipe.

Two conventions, each the one its recipe is written in:

- **fp8 tensor, rowwise and delayed scaling** use an *encode* scale (torchao, Transformer
  Engine): ``q = cast(x * scale)``, ``x_hat = q / scale``; ``scale = max / amax``.
- **MX and NVFP4** use a *decode* scale per block (OCP MX spec, NVIDIA): ``q = cast(x / s)``,
  ``x_hat = q * s``.

Degenerate amax, never a NaN or infinite scale (the failures users file: a zero amax giving a
NaN scale from step 1, a tiny amax giving an infinite one):

- current scaling clamps amax to 1e-12 before ``max / amax``, as torchao does: a zero tensor
  gets a large finite scale and stays zero;
- delayed scaling keeps the previous scale when the history's amax is 0 or not finite, and
  replaces an infinite ``max / amax`` by fp32's largest value, as Transformer Engine does;
- MX exponents are clamped to E8M0's 2^-127..2^127;
- NVFP4's fp32 tensor scale is floored at 2^-121, so that ``(1 / tensor scale) / block scale``
  stays finite even for the smallest E4M3 block scale (2^-6): 2^121 * 2^6 = 2^127.
"""

from __future__ import annotations

import torch

from stabilize.quant.formats import E2M1, E4M3, E8M0_MAX_EXP, E8M0_MIN_EXP, ElemFormat
from stabilize.validate import ConfigError, check_choice

AMAX_EPS = 1e-12  # torchao's clamp before max / amax (torchao.float8.float8_utils.EPS)
FP32_MAX = torch.finfo(torch.float32).max
NVFP4_TENSOR_SCALE_MIN = 2.0**-121
AMAX_ALGOS = ("max", "most_recent")
SCALE_ROUNDINGS = ("floor", "rceil")


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32, over everything or along ``dim`` (kept)."""
    a = x.detach().abs()
    out = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return out.float()


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= ``scale`` (torchao's rowwise recipe rounds scales so)."""
    mant, exp = torch.frexp(scale)  # scale = mant * 2^exp, mant in [0.5, 1)
    pow2 = torch.ldexp(torch.ones_like(scale), exp - 1)
    return torch.where(mant > 0, pow2, scale)


def current_scale(a: torch.Tensor, fmt: ElemFormat, *, pow2: bool = False) -> torch.Tensor:
    """Encode scale ``fmt.max / amax`` from this step's amax (tensor or per row), fp32.

    Computed in fp64 and rounded to fp32 as torchao does, so eager and compiled agree.
    """
    scale = (fmt.max / a.double().clamp(min=AMAX_EPS)).float()
    return round_down_pow2(scale) if pow2 else scale


def history_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is taken from; ``history`` runs oldest -> newest."""
    check_choice("quant.amax_algo", algo, AMAX_ALGOS)
    return history.amax() if algo == "max" else history[-1]


def delayed_scale(
    history: torch.Tensor,
    fmt: ElemFormat,
    *,
    margin: int = 0,
    algo: str = "max",
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """Transformer Engine's delayed scale: ``fmt.max / (amax(history) * 2**margin)``.

    The scale a step uses comes from earlier steps' amaxes only, so a tensor growing faster
    than its history saturates before the scale follows: its values past ``amax(history) *
    2**margin`` are clipped (``x * scale > fmt.max``).
    """
    prev = torch.ones((), device=history.device) if previous is None else previous.float()
    a = history_amax(history.float(), algo)
    fresh = (fmt.max / a) / 2.0**margin
    usable = torch.isfinite(a) & (a > 0)
    scale = torch.where(usable, fresh, prev)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)


class DelayedScaling:
    """One tensor's delayed-scaling state: an amax history and the scale for the next step.

    ``scale`` is what this step's cast uses; ``update(amax)`` records this step's amax (taken
    before the cast) and computes the next step's scale, as Transformer Engine does after each
    forward. Every value stays on the device: no host sync.
    """

    def __init__(
        self,
        fmt: ElemFormat = E4M3,
        *,
        history: int = 1024,
        margin: int = 0,
        algo: str = "max",
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(history, int) or isinstance(history, bool) or history < 1:
            raise ConfigError(f"quant.history={history!r} is not allowed; allowed: an int >= 1")
        if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
            raise ConfigError(f"quant.margin={margin!r} is not allowed; allowed: an int >= 0")
        check_choice("quant.amax_algo", algo, AMAX_ALGOS)
        self.fmt, self.margin, self.algo = fmt, margin, algo
        self.history = torch.zeros(history, device=device)  # oldest -> newest
        self.scale = torch.ones((), device=device)  # TE starts from scale 1

    def update(self, step_amax: torch.Tensor) -> torch.Tensor:
        """Record this step's amax; return (and keep) the scale for the next step."""
        self.history = torch.cat([self.history[1:], step_amax.detach().float().reshape(1)])
        self.scale = delayed_scale(
            self.history, self.fmt, margin=self.margin, algo=self.algo, previous=self.scale
        )
        return self.scale


# ---- MX: one E8M0 (power-of-two) decode scale per block ----------------------------------


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) exactly for a > 0 (frexp: a = m * 2^e with m in [0.5, 1))."""
    return (torch.frexp(a)[1] - 1).float()


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) exactly for a > 0: one less when a is an exact power of two."""
    mant, exp = torch.frexp(a)
    return torch.where(mant == 0.5, exp - 1, exp).float()


def mx_exponent(block_amax: torch.Tensor, fmt: ElemFormat, rounding: str) -> torch.Tensor:
    """The unbiased E8M0 exponent of each block's decode scale (float; NaN for NaN amax).

    - ``floor`` (OCP MX v1.0): 2^(floor(log2 amax) - emax). For E4M3 (emax 8) an amax of
      1.9 * 2^7 = 243.2 gets 2^-1 and scales to 486.4, past 448: the block's largest value is
      clipped, to 224. Any amax mantissa above 1.75 (448 / 256) lands past 448.
    - ``rceil`` (NVIDIA's cuBLAS rule, torchao's and Transformer Engine's default now):
      2^ceil(log2(amax / max)), never past max; 243.2 gets 2^0 and comes back as 240.
    """
    check_choice("quant.scale_rounding", rounding, SCALE_ROUNDINGS)
    a = block_amax.float()
    if rounding == "floor":
        d = a
        e = _floor_log2(d) - fmt.emax
    else:
        d = a / fmt.max  # the fp32 division, as torchao's reference does it
        e = _ceil_log2(d)
    e = torch.where(d > 0, e, torch.full_like(e, E8M0_MIN_EXP))  # zero (or below fp32): smallest
    e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.where(torch.isfinite(a), e, torch.full_like(e, float("nan")))


# ---- NVFP4: an fp32 tensor scale and one E4M3 decode scale per 16 elements ---------------


def nvfp4_tensor_scale(tensor_amax: torch.Tensor) -> torch.Tensor:
    """fp32 tensor scale ``amax / (448 * 6)`` (E4M3's max times E2M1's), floored at 2^-121.

    It makes the largest block's E4M3 scale land at 448, using E4M3's whole range.
    """
    # clamp keeps a NaN amax NaN: the non-finite monitors report it, a scale cannot mend it
    return (tensor_amax.float() / (E4M3.max * E2M1.max)).clamp(min=NVFP4_TENSOR_SCALE_MIN)


def nvfp4_block_scale(block_amax: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """Each block's E4M3 scale (as fp32): ``block_amax / 6 / tensor_scale`` rounded to E4M3.

    Rounded to nearest, it can come out *below* the exact ratio, and then the block's largest
    value scales past 6, by up to E4M3's relative half ulp (1/16): to at most 6.375, short of
    7, where E2M1 overflows. So it comes back as 6, as it would with a wider exponent: the
    rounding shows in ``amax_ratio`` (up to 1.0625), never as a saturated value.
    """
    exact = (block_amax.float() / E2M1.max) / tensor_scale
    return exact.clamp(E4M3.min_normal, E4M3.max).to(torch.float8_e4m3fn).float()
