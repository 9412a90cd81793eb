"""Shared fixtures: offline W&B and datasets, real Hydra composition of configs/."""

from __future__ import annotations

import csv
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# No network here, and no stray files in the user's home: set before wandb/datasets import.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A run that needs the fused CPU kernel builds it first rather than falling back while a
# background build runs, so a run's norm backend never changes mid-run (stabilize/cpu_kernels.py).
os.environ.setdefault("STABILIZE_KERNEL_WAIT", "1")
# Under pytest-xdist (pyproject.toml: two workers on a 2-core machine) each worker and the
# processes it starts use one thread: two workers of two threads each would fight for 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Overrides that make any config a one-second CPU run: no W&B (a test that reads its offline
# files adds logger=wandb), a final eval of 2 batches, and only the last.ckpt every run
# writes (a test that resumes from a periodic checkpoint sets checkpoint_every_n_steps).
FAST = [
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.final_eval_batches=2",
    "trainer.progress=plain",
    "data.batch_size=4",
    "model.block_size=64",
    "optim.warmup_steps=2",
    "logger=none",
]


def compose_run(run_dir, overrides=()):
    """Compose configs/train.yaml with Hydra exactly as the CLI does, into a RunConfig."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import stabilize.train  # noqa: F401  registers the resolvers the config uses
    from stabilize.config_store import store
    from stabilize.run.config import RunConfig

    store()  # the dataclasses' defaults, with any name a test registered since

    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"run_dir={run_dir}", *overrides])
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def read_csv_metrics(run_dir) -> list[dict[str, float]]:
    """All CSV rows of a run, across resumed launches (csv/version_N), in order."""
    rows = []
    versions = sorted(
        (Path(run_dir) / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1])
    )
    for v in versions:
        with open(v / "metrics.csv", newline="") as f:
            for row in csv.DictReader(f):
                rows.append({k: float(x) for k, x in row.items() if x not in ("", None)})
    return rows


def series(rows, key) -> dict[int, float]:
    """{global step: value} for one metric."""
    return {int(r["step"]): r[key] for r in rows if key in r}


def csv_losses(version_dir) -> dict[int, float]:
    """{global step: train/loss} of one launch's CSV (``csv/version_N``)."""
    with open(Path(version_dir) / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    return series(rows, "train/loss")


def train_cli(args, cwd, monkeypatch, capsys, env=None, must_exit=False):
    """``stabilize-train ARGS`` in this process, in ``cwd`` with ``env`` set, exactly as the
    console script runs it (real Hydra composition, real checks, ``sys.exit`` on a failure):
    a CompletedProcess of its exit code and what it printed (``must_exit``: a run that
    returns instead of exiting fails the test). A subprocess costs ~10 s of Lightning import;
    keep those for signals, SIGKILL, torchrun and what must happen in another process."""
    from stabilize.train import main

    monkeypatch.chdir(cwd)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["stabilize-train", *args])
    capsys.readouterr()
    try:
        main()
        if must_exit:
            pytest.fail(f"stabilize-train {args} returned instead of exiting")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["stabilize-train", *args], code, out.out, out.err)


def cli(args, cwd, monkeypatch, capsys) -> tuple[int, str]:
    """``stabilize-train ARGS`` in this process (``train_cli``), which must exit through
    ``sys.exit``: (exit code, stderr)."""
    r = train_cli(args, cwd, monkeypatch, capsys, must_exit=True)
    return r.returncode, r.stderr


def run_cli(args, cwd, env=None, timeout=600):
    """Run a command with the venv's executables first on PATH; returns CompletedProcess."""
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e['PATH']}"
    e["PYTHON"] = sys.executable
    e.update(env or {})
    return subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def torchrun(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 tests/SCRIPT ARGS`` (CPU, gloo), one thread
    a rank; asserts it exited 0 and returns the CompletedProcess."""
    r = run_cli(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / script), *args],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def launch_sh(run_dir, *overrides: str, cwd, nproc: int = 2, env=None):
    """``scripts/launch.sh --nproc-per-node N OVERRIDES...`` (torchrun on CPU, gloo), every
    rank writing to ``run_dir`` (``$STABILIZE_RUN_DIR``); the CompletedProcess."""
    return run_cli(
        [str(ROOT / "scripts" / "launch.sh"), "--nproc-per-node", str(nproc), *overrides],
        cwd=cwd,
        env={**(env or {}), "STABILIZE_RUN_DIR": str(run_dir)},
    )


@pytest.fixture
def fast():
    return list(FAST)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """A test that runs Hydra's app in this process gets Hydra's logging set-up: handlers
    on the root logger bound to that test's captured stream, which pytest then closes.
    Put the root logger back as it was, so later tests do not log into a closed file."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
