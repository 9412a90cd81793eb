"""``NormConfig``: everything about normalization that a sweep may vary, checked on
construction against the registered norm types and what their backends can honour."""

from __future__ import annotations

from dataclasses import dataclass

from stabilize.norms.backends import BACKENDS, FP32_BACKENDS
from stabilize.norms.registry import NORM_TYPES, get_norm_type
from stabilize.validate import check_choice, check_positive

REDUCTION_DTYPES = ("fp32", "bf16", "fp16", "input")
PLACEMENTS = ("pre", "post", "sandwich", "deepnorm")


@dataclass
class NormConfig:
    """Everything about normalization that a sweep may vary.

    type/eps/affine/bias/reduction_dtype/backend describe one norm module; placement and the
    three switches say where the model puts norms (consumed by stabilize.model).
    """

    type: str = "layernorm"
    """A registered norm type (``NORM_TYPES``: layernorm, rmsnorm, scalenorm, ...;
    stabilize/norms/zoo.py)."""
    eps: float = 1e-5
    """Added to the statistic inside the square root, in the reduction dtype."""
    affine: bool = True
    """Learn gamma (and beta where the type has one)."""
    bias: bool = True
    """LayerNorm's beta; ignored by types without one (rmsnorm, scalenorm)."""
    reduction_dtype: str = "fp32"
    """dtype of the mean / sum of squares and of eps: fp32 | bf16 | fp16 | input."""
    backend: str = "auto"
    """auto | torch | explicit | compiled | apex | fused (docs/norms.md)."""
    placement: str = "pre"
    """Where each block puts its norms: pre | post | sandwich | deepnorm."""
    final_norm: bool = True
    """A norm after the last block (``ln_f``)."""
    embed_norm: bool = False
    """A norm on the embeddings (``ln_emb``)."""
    qk_norm: bool = False
    """Per-head norms of queries and keys."""

    def __post_init__(self) -> None:
        check_choice("norm.type", self.type, NORM_TYPES)
        check_positive("norm.eps", self.eps)
        check_choice("norm.reduction_dtype", self.reduction_dtype, REDUCTION_DTYPES)
        check_choice("norm.backend", self.backend, BACKENDS)
        check_choice("norm.placement", self.placement, PLACEMENTS)
        check_backend_supports(self.backend, self.reduction_dtype, self.type)


def check_backend_supports(backend: str, reduction_dtype: str, kind: str | None = None) -> None:
    """Fail early when a backend can never honour the reduction dtype (or norm type)."""
    if kind is not None:
        spec = get_norm_type(kind)
        if not spec.supports(backend):
            why = spec.unsupported.get(backend, f"it has no {backend} kernel for {kind}.")
            raise ValueError(
                f"norm.backend={backend!r} cannot run norm.type={kind!r}: {why} "
                f"Allowed for norm.type={kind!r}: {spec.backends(BACKENDS)}"
            )
    if backend in FP32_BACKENDS and reduction_dtype in ("bf16", "fp16"):
        raise ValueError(
            f"norm.backend={backend!r} cannot honour norm.reduction_dtype={reduction_dtype!r}: "
            f"it always accumulates in fp32. Allowed for a 16-bit reduction: "
            f"['explicit', 'auto']"
        )
