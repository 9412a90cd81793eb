"""The benchmark scripts run and print what they promise (numbers are not asserted: this
machine is shared and noisy; the ratios go in issue notes, not in tests)."""

from __future__ import annotations

import sys

from stabilize.norms import auto_backend

from conftest import ROOT, run_cli


def test_bench_norms_smoke(tmp_path):
    md = tmp_path / "table.md"
    r = run_cli(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_norms.py"),
            "--quick",
            "--types",
            "rmsnorm,layernorm",
            "--backends",
            "auto,torch,explicit,apex",
            "--dtypes",
            "fp16",
            "--shapes",
            "64x128",
            "--reps",
            "2",
            "--markdown-out",
            str(md),
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "| F.layer_norm |" in out and "| copy_ |" in out
    picked = auto_backend("rmsnorm", "cpu")
    assert f"| rmsnorm | auto | fp32 | fp16 | 64x128 | {picked} |" in out
    # a backend that cannot honour a setting is listed with the reason, never skipped
    assert "| rmsnorm | torch | input | fp16 | 64x128 | - | n/a: norm.backend='torch' cannot" in out
    assert "n/a: NVIDIA apex is not importable" in out
    assert "## Targets" in out and "T1 fp16 64x128 auto rmsnorm vs F.layer_norm" in out
    assert md.read_text().count("\n|") >= 10


def test_bench_step_smoke(tmp_path):
    r = run_cli(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_step.py"),
            "--configs",
            "tiny",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| tiny |" in r.stdout and "lightning" in r.stdout.lower()


def test_bench_monitors_smoke(tmp_path):
    r = run_cli(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_monitors.py"),
            "--configs",
            "tiny",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--repeats",
            "1",
            "--reps",
            "1",
            "--threads",
            "1",
            "--logger",
            "none",
            "--toggle-steps",
            "40",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| tiny |" in r.stdout and "restore from memory" in r.stdout
    assert "| tiny | 1 |" in r.stdout  # the in-run toggle table: one ABBA quad
    assert "(in-run ABBA toggle)" in r.stdout
