"""Rules of the house, enforced: ruff, the import-linter layering contract, and purity of the
model and norms (no torch.distributed, which import-linter cannot forbid as a subpackage)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [
    ROOT / "stabilize" / "numerics.py",
    *sorted((ROOT / "stabilize" / "norms").glob("*.py")),
    ROOT / "stabilize" / "cpu_kernels.py",
    *sorted((ROOT / "stabilize" / "model").glob("*.py")),
]
FORBIDDEN = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "wandb", "torch.distributed")


def _tool(name):
    exe = Path(sys.executable).parent / name
    path = str(exe) if exe.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return path


def test_ruff_is_clean():
    r = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_contracts_hold():
    r = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods |= {f"{node.module}.{a.name}" for a in node.names}
    return mods


def test_model_and_norms_import_no_training_stack():
    bad = {
        f"{p.relative_to(ROOT)}: {m}"
        for p in PURE
        for m in imported_modules(p)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not bad, sorted(bad)


def test_the_purity_check_itself_sees_a_forbidden_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from torch.distributed import all_reduce\nimport torch\n")
    assert "torch.distributed.all_reduce" in imported_modules(f)
