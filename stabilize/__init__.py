"""stabilize: a mixed-precision training stability harness (see docs/ARCHITECTURE.md).

The public API (docs/design-your-model.md) is exported here lazily (PEP 562):
``import stabilize`` loads no torch, so ``stabilize-train --help`` stays light, and each name
loads its module on first use: the stability callback for any LightningModule
(docs/your-model.md), its settings, and norm discovery and surgery on any model."""

import logging
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("stabilize")  # recorded in repro bundles (stability/bundle.py)
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "StabilityCallback": "stabilize.lit.stability",
    "StabilityAbort": "stabilize.stability.controller",
    "Guard": "stabilize.guard",
    "Verdict": "stabilize.guard",
    "HFStabilityCallback": "stabilize.hf_trainer",
    "MonitorConfig": "stabilize.monitors",
    "RollbackConfig": "stabilize.rollback",
    "FaultConfig": "stabilize.faults",
    "find_norms": "stabilize.norms.surgery",
    "swap_norms": "stabilize.norms.surgery",
    "FoundNorm": "stabilize.norms.surgery",
    "inspect_model": "stabilize.model.foreign",
    "ModelMap": "stabilize.model.foreign",
}
__all__ = ["__version__", *_EXPORTS]


class _CpuNoise(logging.Filter):
    """torchao's import (transformers imports it whenever it is installed) logs a warning
    for each CUDA extension a machine without one cannot load, and torch a deprecation for
    two of torchao's enums: lines a user can do nothing about, before their run's own. Only
    those records are dropped; every other torchao and torch record goes through."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        cuda_ext = msg.startswith("Failed to load ") and "torchao" in msg
        enum = "is an Enum subclass and is now natively supported" in msg and any(
            e in msg for e in ("KernelPreference", "ScaleCalculationMode")
        )
        return not (cuda_ext or enum)


for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).addFilter(_CpuNoise())


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stabilize' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
