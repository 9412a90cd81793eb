"""The one place a norm type is defined: a ``NormType`` subclass, registered by name.

A norm type says everything that differs between LayerNorm, RMSNorm, ScaleNorm and their
siblings, and nothing else:

- its statistic, written out in tensor ops (``normalize``): what the ``explicit`` backend
  runs in the reduction dtype, and what ``compiled`` traces;
- its parameter shapes (``weight_shape``, ``has_bias``) and their initial values
  (``weight_init``);
- what each fused backend does for it (``torch_forward``, ``apex_forward``,
  ``fused_forward``), or ``None`` where that backend cannot run it (with ``unsupported``
  saying why, for the error message);
- a float64 reference from its definition (``reference64``) and how its per-row statistic
  reads as a mean square (``mean_square``), for audits and monitors.

Everything else (autocast, the reduction dtype, casts, gamma/beta, backend choice) is the
same for every type and lives in ``backends.py`` and ``module.py``. ``NORM_TYPES`` and the
allowed values of ``norm.type`` follow this registry, so a type registered from outside the
package (a test, a user's module imported before the config is built) is accepted by the
config, built by ``build_norm`` and trained like a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import torch

from stabilize.registry import Registry

# Backends whose work a norm type implements itself (the others run ``normalize``).
KERNEL_BACKENDS = ("torch", "apex", "fused")


class NormType:
    """One normalization over the last dimension; subclass, set ``name`` and register.

    Instances are stateless singletons (one per registered name): a ``Norm`` module holds
    its type's instance and all its parameters itself.
    """

    name: ClassVar[str] = ""
    has_bias: ClassVar[bool] = False  # a beta; NormConfig.bias switches it off
    # Kernel backends: a method (see RMSNorm in zoo.py for the signatures) or None.
    torch_forward: ClassVar[Callable | None] = None
    apex_forward: ClassVar[Callable | None] = None
    fused_forward: ClassVar[Callable | None] = None
    # auto picks torch_forward on every device, not only CUDA (F.layer_norm is fused on CPU;
    # F.rms_norm is not in torch 2.13, see docs/norms.md).
    torch_on_every_device: ClassVar[bool] = False
    # Why a kernel backend cannot run this type: {backend: reason}, for the error message.
    unsupported: ClassVar[dict[str, str]] = {}

    # ---- parameters -------------------------------------------------------------------------
    def weight_shape(self, dim: int) -> tuple[int, ...]:
        """Shape of gamma for ``dim`` features: [D] by default; () for a scalar gain."""
        return (dim,)

    def weight_init(self, dim: int) -> float:
        """The value gamma is reset to (beta, where present, is reset to 0)."""
        return 1.0

    # ---- numerics ---------------------------------------------------------------------------
    def normalize(self, x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized x, per-row statistic [..., 1]), both in x's dtype (the reduction
        dtype: the caller casts). eps is added to the statistic here, in that dtype; the
        statistic must be inf exactly for the rows whose reduction overflowed."""
        raise NotImplementedError

    def reference64(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The normalized x (before gamma/beta) in float64, from the type's definition."""
        raise NotImplementedError

    def mean_square(self, stat: torch.Tensor, dim: int) -> torch.Tensor:
        """The row's mean square (+ eps) that ``normalize``'s statistic stands for."""
        return stat

    # ---- backends ---------------------------------------------------------------------------
    def supports(self, backend: str) -> bool:
        """Can ``backend`` run this type? ``explicit``, ``compiled`` and ``auto`` always can."""
        return backend not in KERNEL_BACKENDS or getattr(self, f"{backend}_forward") is not None

    def backends(self, allowed: Sequence[str]) -> list[str]:
        """The backends among ``allowed`` that can run this type, in that order."""
        return [b for b in allowed if self.supports(b)]

    def __reduce__(self):
        # Copies (deepcopy of a model, pickling) resolve to the registered singleton.
        return (get_norm_type, (self.name,))

    def __repr__(self) -> str:
        return f"<norm type {self.name!r}>"


_REGISTRY: Registry[NormType] = Registry("norm.type")
T = TypeVar("T", bound=type[NormType])


def register_norm(cls: T) -> T:
    """Class decorator: make ``cls.name`` a value of ``norm.type``. A name is taken once."""
    if not (isinstance(cls, type) and issubclass(cls, NormType)):
        raise TypeError(f"register_norm expects a NormType subclass, got {cls!r}")
    name = cls.name
    if not name or not isinstance(name, str):
        raise ValueError(f"{cls.__name__}.name must be a non-empty string, got {name!r}")
    # one stateless instance per name (a new one each call: registering twice is refused)
    _REGISTRY.register(name, cls())
    return cls


def unregister_norm(name: str) -> None:
    """Remove a registered type (tests that register their own restore the registry)."""
    _REGISTRY.unregister(name)


def get_norm_type(name: str) -> NormType:
    """The registered type called ``name``; unknown names fail with the allowed list."""
    return _REGISTRY.lookup(name)


# The registered names in registration order, read live.
NORM_TYPES: Sequence[str] = _REGISTRY.names
