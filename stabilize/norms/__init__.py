"""The normalization zoo: LayerNorm, RMSNorm, ScaleNorm (and any registered sibling) with an
honest reduction dtype.

- registry.py: ``NormType`` (one class per norm type: its statistic, parameter shapes,
  reset, and what each kernel backend does for it) and ``register_norm``; ``NORM_TYPES``
  follows the registry.
- zoo.py: the built-in types.
- backends.py: explicit / torch / compiled / apex / fused / auto, functions over a type.
- config.py: ``NormConfig`` and its checks.
- module.py: ``Norm`` (the nn.Module), ``build_norm``, ``set_reduction_dtype``.
- surgery.py: ``find_norms`` and ``swap_norms``, the norms of a model we did not build.

Add a norm type: a ``NormType`` subclass decorated with ``@register_norm`` (zoo.py shows
three), a ``configs/norm/<name>.yaml``, and tests (tests/test_norm_registry.py registers one
from outside the package). docs/norms.md explains the numerics.
"""

from stabilize.norms import zoo  # noqa: F401  registers the built-in types
from stabilize.norms.backends import (
    APEX_HELP,
    BACKENDS,
    activation_dtype,
    apex_norm,
    auto_backend,
    autocast_dtype,
    compiled_norm,
    explicit_norm,
    has_cpp_compiler,
)
from stabilize.norms.config import (
    PLACEMENTS,
    REDUCTION_DTYPES,
    NormConfig,
    check_backend_supports,
)
from stabilize.norms.module import Norm, build_norm, set_reduction_dtype
from stabilize.norms.registry import (
    NORM_TYPES,
    NormType,
    get_norm_type,
    register_norm,
    unregister_norm,
)
from stabilize.norms.surgery import FoundNorm, find_norms, swap_norms

__all__ = [
    "APEX_HELP",
    "BACKENDS",
    "FoundNorm",
    "NORM_TYPES",
    "PLACEMENTS",
    "REDUCTION_DTYPES",
    "Norm",
    "NormConfig",
    "NormType",
    "activation_dtype",
    "apex_norm",
    "auto_backend",
    "autocast_dtype",
    "build_norm",
    "check_backend_supports",
    "compiled_norm",
    "explicit_norm",
    "find_norms",
    "get_norm_type",
    "has_cpp_compiler",
    "register_norm",
    "set_reduction_dtype",
    "swap_norms",
    "unregister_norm",
]
