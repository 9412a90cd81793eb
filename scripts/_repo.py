"""Puts the repository root on ``sys.path`` for a script run as ``python scripts/NAME.py``.

The benchmark and research libraries (``benchmarks/`` at the repository root) are not part
of the installed ``stabilize`` package, so a script reaches them from the checkout it runs
in: Python puts only ``scripts/`` on the path, and each script that imports ``benchmarks``
imports this module first (``import _repo``). The tests get the root from pytest's
``pythonpath`` setting (pyproject.toml).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after scripts/ itself: a sibling script still wins
