"""stabilize: a mixed-precision training stability harness (see docs/ARCHITECTURE.md).

The public API (issue 36; docs/design-your-model.md) is exported here lazily (PEP 562):
``import stabilize`` loads no torch, so ``stabilize-train --help`` stays light, and each name
loads its module on first use: the stability callback for any LightningModule
(docs/your-model.md), its settings, and norm discovery and surgery on any model."""

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stabilize' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
