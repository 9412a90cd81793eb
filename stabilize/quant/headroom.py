"""Headroom of one tensor under one quantization scheme: the counts the probe reports.

For a tensor about to enter a quantized GEMM (fprop's input and weight, dgrad's grad-output,
wgrad's input and grad-output), six numbers, each a 0-d fp32 tensor on the tensor's device,
so they can join the probe's other flags in its one host gather (``Headroom.stack``):

- ``amax``: max |x| before scaling (the number a delayed-scaling history records).
- ``amax_ratio``: the largest scaled magnitude over the format's max, before the cast. Near 1
  under current scaling (below 1 with power-of-two scales); above 1 means values were clipped:
  delayed scaling behind a growing tensor, or an MX FLOOR block with amax mantissa > 1.75.
- ``saturated``: the share of elements that saturation changed, counted on the scaled values
  *before* the cast, which hides them (E4M3's cast turns 480, 1e4 and inf into 448). "Changed"
  means past ``ElemFormat.overflow_from``: a value that rounds to max anyway is not counted.
- ``underflow``: the share of elements that were non-zero and come back as 0 (over all
  elements, as Transformer Engine's debug tooling counts it).
- ``clipped_blocks``: the share of scale groups (the tensor, a row, an MX or NVFP4 block) with
  at least one saturated element. For tensor and delayed scaling this is 0 or 1.
- ``sqnr_db``: 20 log10(||x|| / ||x - x_hat||) of the dequantized tensor against x; +inf
  when the quantization is exact (a zero tensor included).

The counts assume a finite input: a NaN or inf in x is the non-finite monitors' to report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from stabilize.quant.formats import overflows
from stabilize.quant.quantize import Quantized, Scheme, quantize


@dataclass
class Headroom:
    """The counts for one tensor; every field a 0-d fp32 tensor on the tensor's device."""

    amax: torch.Tensor
    amax_ratio: torch.Tensor
    saturated: torch.Tensor
    underflow: torch.Tensor
    clipped_blocks: torch.Tensor
    sqnr_db: torch.Tensor

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def stack(self) -> torch.Tensor:
        """The counts as one 1-D fp32 tensor in ``names()`` order (for one host gather)."""
        return torch.stack([getattr(self, n).float().reshape(()) for n in self.names()])

    @classmethod
    def unstack(cls, values) -> dict[str, float]:
        """Host-side: a gathered ``stack()`` (tensor or list) back to named floats."""
        vals = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        if len(vals) != len(cls.names()):
            raise ValueError(
                f"headroom values={len(vals)} entries do not match the fields; "
                f"allowed: {len(cls.names())} entries {list(cls.names())}"
            )
        return dict(zip(cls.names(), (float(v) for v in vals), strict=True))


def _sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """20 log10(||x|| / ||x - x_hat||); +inf where the noise is zero (no 0/0 NaN)."""
    signal = torch.linalg.vector_norm(x)
    noise = torch.linalg.vector_norm(x - x_hat)
    db = 20 * torch.log10(signal / noise.clamp(min=torch.finfo(torch.float32).tiny))
    return torch.where(noise > 0, db, torch.full_like(db, math.inf))


def headroom_of(qz: Quantized, x: torch.Tensor) -> Headroom:
    """The counts for ``x`` already quantized as ``qz`` (``x`` as given to ``quantize``)."""
    fmt = qz.scheme.fmt
    hp = x.detach().float().reshape(qz.scaled.shape)  # [G, n], as quantize grouped it
    mag = qz.scaled.abs()
    sat = overflows(mag, fmt)  # [G, n]
    x_hat = qz.dequantize().reshape(qz.scaled.shape)
    n = max(hp.numel(), 1)
    zero = torch.zeros((), device=hp.device)
    return Headroom(
        amax=qz.group_amax.amax() if hp.numel() else zero,
        amax_ratio=(mag.amax() / fmt.max) if hp.numel() else zero,
        saturated=sat.sum().float() / n,
        underflow=((hp != 0) & (x_hat == 0)).sum().float() / n,
        clipped_blocks=sat.any(dim=-1).float().mean() if hp.numel() else zero,
        sqnr_db=_sqnr_db(hp, x_hat),
    )


def headroom(x: torch.Tensor, scheme: Scheme, scale: torch.Tensor | None = None) -> Headroom:
    """The counts for ``x`` under ``scheme`` (``scale``: a delayed-scaling state's scale)."""
    return headroom_of(quantize(x, scheme, scale), x)


def stack_all(rows: dict[str, Headroom]) -> tuple[list[str], torch.Tensor]:
    """Many tensors' counts as one [len(rows), len(names())] device tensor, with row names.

    The probe puts one row per quantized GEMM operand ("h.0.mlp.fc.input", ...) and gathers
    the whole table with its other flags in one transfer; ``Headroom.unstack`` reads a row.
    """
    names = list(rows)
    if not names:
        return [], torch.zeros(0, len(Headroom.names()))
    return names, torch.stack([rows[n].stack() for n in names])
