"""Rules of the house, enforced: ruff, the import-linter layering contract, and purity of the
model and norms (no torch.distributed, which import-linter cannot forbid as a subpackage)."""

from __future__ import annotations

import ast
import json
import os
import re
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


# ---- no import circle among the package's modules -------------------------------------------
def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file (a function-level or
    ``TYPE_CHECKING`` import counts too: it is a circle as soon as it runs). ``from pkg import
    name`` is an edge to the submodule ``pkg.name`` where there is one, else to ``pkg``."""
    files = {}
    for p in (root / package).rglob("*.py"):
        parts = p.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]  # fmt: skip
            else:
                continue
            graph[mod] |= {o for n in names if (o := owner(n)) and o != mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle_among_the_packages_modules():
    cycles = import_cycles(module_graph(ROOT, "stabilize"))
    assert not cycles, [" <-> ".join(c) for c in cycles]


def test_the_circle_check_itself_sees_a_function_level_circle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g()\n")
    (pkg / "b.py").write_text("from pkg import a\n\ndef g():\n    return a\n")
    (pkg / "c.py").write_text("from . import b\n")  # imports into the circle, not part of it
    assert import_cycles(module_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b"]]


# ---- sizes: one concept per file ------------------------------------------------------------
def test_no_package_file_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in (ROOT / "stabilize").rglob("*.py")}  # fmt: skip
    assert sizes and not {p: n for p, n in sizes.items() if n > 400}


def test_scripts_readme_says_who_runs_every_script():
    readme = (ROOT / "scripts" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \| ", readme, flags=re.M))
    have = {p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert listed == have, (sorted(have - listed), sorted(listed - have))


# ---- the wheel holds the harness only; importing it changes no environment ------------------
def test_the_packages_setup_py_installs_hold_no_benchmark_or_research_module(monkeypatch):
    """What ``pip install .`` installs: setup.py's package list, read by running it (from the
    repo root, as pip does) with a stand-in ``setup``. benchmarks/ (the benchmark and research
    libraries) is not in it, and no installed package holds a module of that name
    (tests/test_wheel.py checks the built wheel's files too)."""
    import runpy
    from unittest import mock

    import setuptools

    monkeypatch.chdir(ROOT)
    with mock.patch.object(setuptools, "setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    packages = setup.call_args.kwargs["packages"]
    assert "stabilize" in packages and "stabilize.monitors" in packages
    assert not [p for p in packages if not p.startswith("stabilize")], packages
    research = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    assert {"lib", "stats", "forecast_score", "spike_eval"} <= research
    installed = {
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for pkg in packages if pkg.startswith("stabilize") and pkg != "stabilize.configs"
        for p in (ROOT / pkg.replace(".", "/")).glob("*.py")
    }  # fmt: skip
    assert not [m for m in installed if m.rpartition(".")[2] in research or ".bench" in m]


def test_importing_stabilize_sets_no_environment_variable():
    """A fresh process: the third-party stack first (Lightning itself sets two variables when
    imported), then the harness's entry points; os.environ is the same before and after."""
    code = (
        "import os, json\n"
        "import lightning, torch, hydra, wandb  # their own import-time settings aside\n"
        "before = dict(os.environ)\n"
        "import stabilize, stabilize.guard, stabilize.lit.stability, stabilize.train\n"
        "after = dict(os.environ)\n"
        "print(json.dumps({k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()"
        " if before.get(k) != after.get(k)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HF_"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == {}
    # a plain loop's import pulls no Lightning, so nothing at all may change there
    bare = "import os; b = dict(os.environ); import stabilize.guard; print(dict(os.environ) == b)"
    r = subprocess.run([sys.executable, "-c", bare], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout.split()[-1] == "True", r.stderr[-3000:]


def test_no_issue_numbers_in_the_package():
    """The code says why in its own words: an issue number means nothing to its reader."""
    import re

    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "stabilize").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\b[Ii]ssues? \d+", line)
    ]
    assert not found, found
