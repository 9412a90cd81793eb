"""scripts/gpu_check.sh without a GPU: its bash parses, every training
override it passes composes with Hydra into a RunConfig, and its Python snippets compile,
import names that exist and (the norm one) run on CPU."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT, compose_run, run_cli

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_script_parses_and_prints_help():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    r = run_cli([str(SCRIPT), "--help"], cwd=ROOT)
    assert r.returncode == 0 and "under 8 minutes" in r.stdout
    assert run_cli([str(SCRIPT), "--bogus"], cwd=ROOT).returncode == 2
    assert "--cost" in r.stdout and "4. (--cost)" in r.stdout


def test_the_cost_stage_configs_compose_for_both_benchmarks(tmp_path):
    """Stage 4 (``--cost``) runs bench_interleaved.py and bench_monitors.py on benchmarks.lib's
    gpt-125m config in bf16-mixed: both compose into that run here (no GPU needed)."""
    from benchmarks.lib import CONFIGS, compose_cfg, run_overrides

    text = SCRIPT.read_text()
    assert "--configs gpt-125m --precision bf16-mixed" in text
    cfg = compose_cfg(str(tmp_path), run_overrides(CONFIGS["gpt-125m"], "bf16-mixed", 10, "none"))
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.d_model) == ("gpt-125m", 12, 768)
    assert cfg.precision.name == "bf16-mixed" and cfg.data.batch_size == 4


def overrides() -> list[str]:
    r = run_cli([str(SCRIPT), "--print-overrides"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_training_overrides_compose_into_the_gpt_1_3b_fp16_run(tmp_path):
    ov = overrides()
    cfg = compose_run(tmp_path, ov)
    assert cfg.model.name == "gpt-1.3b" and cfg.model.n_layer == 24
    assert cfg.precision.name == "fp16-mixed"
    assert cfg.trainer.max_steps == 20 and cfg.trainer.accelerator == "gpu"
    assert cfg.rollback.enabled and cfg.rollback.snapshot_every == 5
    # the same list is what stabilize-plan gets, with its own plan.* keys on top
    from stabilize.plan.cli import main as plan_main

    assert plan_main([*ov, "plan.gpu=a100-80gb", "plan.gpus_per_node=1"]) == 0


@pytest.fixture(scope="module")
def snippets(tmp_path_factory):
    d = tmp_path_factory.mktemp("snippets")
    r = run_cli([str(SCRIPT), "--dump-python", str(d)], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return {p.stem: p.read_text() for p in d.glob("*.py")}


@pytest.mark.parametrize("name", ["train", "norms"])
def test_snippets_compile_and_import_names_that_exist(snippets, name):
    tree = ast.parse(snippets[name], filename=f"gpu_check:{name}")
    compile(tree, f"gpu_check:{name}", "exec")
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert froms  # it does import from stabilize, so a rename shows here
    for node in froms:
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
    if name == "train":  # the clock wraps this method of the controller
        from stabilize.stability.controller import RollbackController

        assert callable(RollbackController.snapshot)


def test_norm_snippet_runs_on_cpu_and_shows_the_fp16_overflow(snippets):
    env = {**os.environ, "NORM_DEVICE": "cpu", "NORM_BACKENDS": "explicit,torch"}
    r = subprocess.run(
        [sys.executable, "-c", snippets["norms"]], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    rows = {tuple(line.split()[:3]): line for line in r.stdout.splitlines()[1:]}
    for kind in ("layernorm", "rmsnorm", "scalenorm"):
        assert "zero; other rows finite" in rows[(kind, "explicit", "fp16")]
        assert "finite; other rows finite" in rows[(kind, "explicit", "fp32")]
        assert "refused: norm.backend='torch'" in rows[(kind, "torch", "fp16")]
        assert "finite; other rows finite" in rows[(kind, "torch", "fp32")]
