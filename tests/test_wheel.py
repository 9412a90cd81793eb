"""Installable anywhere: the wheel carries Hydra's configs, and ``stabilize-train``
from a wheel installed into a fresh venv runs ``--help`` and two training steps from a
directory outside the repo, with no repo file in reach.

The venv gets the dependencies (torch, lightning, ...) through a .pth file naming the running
interpreter's site-packages, so nothing is downloaded; the wheel itself goes in with
``--no-deps``. The .pth only adds those directories to sys.path (.pth files inside them are
not processed), so an editable install of the repo there does not leak in.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# What a build needs, and all a build sees: the wheel is built from a copy of just these, so a
# file the package reads from the checkout at run time is missing in the venv too.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "stabilize", "configs")
# Variables that would point the installed package back at the checkout.
REPO_POINTERS = ("PYTHONPATH", "STABILIZE_CONFIG_DIR", "STABILIZE_RUN_DIR", "STABILIZE_SWEEP_DIR")
QUICK = [
    "logger=none",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.progress=plain",
    "data.batch_size=4",
    "data.max_chars=20000",
    "model.block_size=64",
    "optim.warmup_steps=1",
]


def _run(args, cwd, env=None, timeout=600):
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{shlex.join(map(str, args))}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


class Venv:
    """A fresh venv with the wheel installed; ``run`` executes from a directory outside the
    repo with nothing pointing back at it."""

    def __init__(self, root: Path, wheel: Path) -> None:
        self.root, self.wheel = root, wheel
        _run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], cwd=root)
        self.python = root / "venv" / "bin" / "python"
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        self.site = Path(_run([self.python, "-c", purelib], cwd=root).stdout.strip())
        # The running pip installs into the venv's interpreter (pip >= 22.3): no ensurepip.
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python"]
        _run([*pip, self.python, "install", "--no-deps", "--no-index", wheel], cwd=root)
        # Only then the dependencies: pip must not see (and offer to replace) a stabilize
        # installed beside them.
        deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
        (self.site / "_stabilize_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
        # A real install of the ninja dependency puts its binary in the venv's bin, where
        # cpu_kernels looks first; without it the system's ninja would build the fused kernel,
        # and a ninja of another version rebuilds the shared cached one (its log hashes differ).
        if ninja := shutil.which("ninja", path=str(Path(sys.executable).parent)):
            (self.python.parent / "ninja").symlink_to(ninja)
        self.cwd = root / "elsewhere"
        self.cwd.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in REPO_POINTERS}
        self.env |= {"STABILIZE_RUN_ID": "wheel", "WANDB_MODE": "offline"}

    def run(self, *args: str | Path, env: dict | None = None) -> subprocess.CompletedProcess:
        return _run(list(args), cwd=self.cwd, env={**self.env, **(env or {})})


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("wheel")
    assert REPO not in root.parents
    src = root / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist"]
    _run([*pip, *build, src], cwd=root)
    (wheel,) = (root / "dist").glob("stabilize-*.whl")
    return Venv(root, wheel)


def test_the_wheel_carries_every_config(venv):
    names = set(zipfile.ZipFile(venv.wheel).namelist())
    yamls = {p.relative_to(REPO / "configs").as_posix() for p in REPO.glob("configs/**/*.yaml")}
    assert "train.yaml" in yamls and len(yamls) > 20
    assert {n.removeprefix("stabilize/configs/") for n in names if n.endswith(".yaml")} == yamls
    # every package of the tree (a directory with an __init__.py) is in the wheel
    packages = {p.parent.relative_to(REPO).as_posix() for p in REPO.glob("stabilize/**/*.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names
    assert "stabilize/csrc/cpu_kernels.cpp" in names  # the fused CPU kernel's source
    assert "stabilize/py.typed" in names  # type checkers read the annotations (PEP 561)


def test_the_wheel_installs_no_benchmark_or_research_module(venv):
    """benchmarks/ (the benchmark scripts' and evaluations' libraries) stays in the checkout:
    no file of the wheel is one of its modules, under any package."""
    names = zipfile.ZipFile(venv.wheel).namelist()
    research = {p.name for p in (REPO / "benchmarks").glob("*.py")} - {"__init__.py"}
    assert {"lib.py", "forecast_score.py", "spike_eval.py"} <= research
    tops = {n.split("/")[0] for n in names}
    assert tops == {"stabilize", *(t for t in tops if t.endswith(".dist-info"))}, tops
    assert not [n for n in names if n.rpartition("/")[2] in research or "/bench/" in n]


def test_the_installed_package_is_the_venvs(venv):
    # find_spec locates without running the modules (seconds of torch and Lightning imports)
    probe = (
        "import importlib.util as u\n"
        "for m in ('stabilize', 'stabilize.train', 'stabilize.data'): print(u.find_spec(m).origin)"
    )
    files = [Path(line) for line in venv.run(venv.python, "-c", probe).stdout.split()]
    assert len(files) == 3
    for f in files:
        assert f.is_relative_to(venv.site / "stabilize") and REPO not in f.parents, f
    assert (venv.site / "stabilize" / "configs" / "train.yaml").is_file()


def test_stabilize_train_help_and_two_steps_from_outside_the_repo(venv):
    exe = venv.python.parent / "stabilize-train"
    # --help lists the groups of the configs that the wheel carries
    out = venv.run(exe, "--help").stdout
    assert "norm: layernorm, rmsnorm, scalenorm" in out and "logger: none, wandb" in out

    r = venv.run(exe, *QUICK)
    run_dir = venv.cwd / "runs" / "main" / "wheel"  # experiment=main names it; our run id
    assert f"run dir: {run_dir}" in r.stdout and "done: 2 steps" in r.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "done" and result["global_step"] == 2
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["max_steps"] == 2
    assert (run_dir / "csv" / "version_0" / "metrics.csv").is_file()
    # Hydra composed it from the installed package's configs, not the checkout's
    hydra = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    main = [s for s in hydra["runtime"]["config_sources"] if s["provider"] == "main"]
    assert [Path(s["path"]) for s in main] == [venv.site / "stabilize" / "configs"]


def test_stabilize_plan_composes_the_installed_configs(venv):
    exe = venv.python.parent / "stabilize-plan"
    out = venv.run(exe, "model=gpt-125m", "plan.gpu=h100-80gb").stdout
    assert out.startswith("stabilize-plan: gpt-125m (") and "per GPU" in out


def test_config_dir_is_the_override_else_the_checkouts(monkeypatch, tmp_path):
    """The third place, the installed copy, is what the venv tests above check."""
    from stabilize.paths import config_dir

    monkeypatch.setenv("STABILIZE_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
    monkeypatch.delenv("STABILIZE_CONFIG_DIR")
    assert config_dir() == REPO / "configs"  # this checkout has no stabilize/configs


@pytest.mark.slow
def test_the_fused_cpu_kernel_builds_from_the_installed_package(venv, tmp_path):
    """The C++ source ships in the wheel (stabilize/csrc/): the build command reads no repo
    file (minutes: a fresh build directory, so nothing is taken from the cache)."""
    from stabilize import cpu_kernels

    if cpu_kernels.missing_tools():
        pytest.skip(f"no build tools: {cpu_kernels.missing_tools()}")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = venv.run(venv.python, "-m", "stabilize.cpu_kernels", "build", env=env).stdout
    built = Path(out.split()[-3])  # "fused CPU RMSNorm kernel: PATH (N s)"
    assert built.is_relative_to(tmp_path) and built.suffix == ".so"
