"""stabilize: a mixed-precision training stability harness (see docs/ARCHITECTURE.md).

Importing the package loads nothing heavy: ``stabilize-train --help`` stays light, and the
public API of issue 36 (docs/design-your-model.md) will be exported here lazily."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stabilize")  # recorded in repro bundles (stability/bundle.py)
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"
