"""The stability engine's three adapters held to one behaviour (docs/design-engine.md): the
same scenarios on the same tiny Llama (tests/adapters_common.py) under a real Lightning
Trainer (``StabilityCallback``), a plain loop (``Guard``) and a real ``transformers.Trainer``
(``HFStabilityCallback``):

- a NaN planted once (a transient fault) is rolled back to the last snapshot and the run
  goes on to its step count (the Hugging Face Trainer counts its own steps: it ends with
  the undone steps fewer, and says so);
- with gradient accumulation over 2 micro-batches, a NaN in the *first* one is rolled back
  as well, its bundle holds both micro-batches, and a fresh process replays it;
- per-row overflow counts of fp16-reducing norms equal an independent float64 count;
- a deterministic fault (the same overflow on a re-run and on other batches) is answered by
  the ladder's rung that changes something (the norms' reduction in fp32), and the run ends.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from adapters_common import ADAPTERS, run  # noqa: E402
from your_lm import nan_once  # noqa: E402

HERE = Path(__file__).parent
STEPS = 8
FP16_INF_FROM = 65520.0  # the smallest float64 sum that fp16 rounds to inf
DRIFT = {"kind": "stream_drift", "layer": 0, "step": 4, "target": 300.0, "target_step": 5}


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def _rollbacks(run_dir: Path) -> list[dict]:
    return [e for e in _events(run_dir) if e["monitor"] == "rollback"]


def _finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def _nan_in_block_1(at: int):
    return lambda model: model.model.layers[1].register_forward_hook(nan_once(at))


def _undone(rolled: list[dict]) -> int:
    return sum(e["step"] - e["extra"]["restored_step"] for e in rolled)


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_transient_nan_is_rolled_back_and_the_run_reaches_its_steps(kind, tmp_path):
    r = run(kind, tmp_path, STEPS, hook=_nan_in_block_1(4), rollback={"snapshot_every": 2})
    (rolled,) = _rollbacks(tmp_path)
    assert (rolled["step"], rolled["extra"]["restored_step"]) == (4, 2)
    assert rolled["extra"]["class"] == "transient" and rolled["extra"]["remedy"] == "retry"
    assert _finite(r.model)
    # what the probe sees on a model we did not build, said once at start-up
    assert r.console.count("[stability] LlamaForCausalLM: 2 blocks, 5 norms") == 1, r.console
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "done" and result["model_step"] == r.model_step
    if kind == "hf":  # the Trainer's own count goes on; the model's is 2 steps short
        assert (r.loop_steps, r.model_step) == (STEPS, STEPS - _undone([rolled]))
        assert "the data goes on after a rollback" in r.console  # said at start-up
    else:  # the model's steps reach the budget; the loop took the undone ones too
        assert (r.model_step, r.loop_steps) == (STEPS, STEPS + _undone([rolled]))


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_nan_in_the_first_of_two_micro_batches_is_rolled_back_and_replayed(kind, tmp_path):
    # forward 7 is step 4's first micro-batch (2 per step)
    r = run(kind, tmp_path, STEPS, accumulate=2, hook=_nan_in_block_1(7),
            rollback={"snapshot_every": 2})  # fmt: skip
    faults = [e for e in _events(tmp_path) if e["kind"] == "rollback"]
    faults = [e for e in faults if e["monitor"] != "rollback"]
    assert [e["step"] for e in faults] == [4] and faults[0]["monitor"] == "nonfinite"
    assert faults[0]["extra"]["class"] == "transient"  # its re-run ran both micro-batches
    assert [e["step"] for e in _rollbacks(tmp_path)] == [4]
    assert _finite(r.model)
    # the bundle holds both micro-batches of the step, and a fresh process replays them
    from stabilize.replay.bundle_files import open_bundle

    bundle = tmp_path / "bundles" / "step-000004-nonfinite"
    (rank,) = open_bundle(bundle).load("batch.pt")["ranks"]
    assert len(rank["positions"]) == 2 and rank["positions"][1] == rank["positions"][0] + 1
    flags = [] if kind == "hf" else ["--trust-code"]  # HF: rebuilt from its config alone
    exe = Path(sys.executable).parent / "stabilize-replay"
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    p = subprocess.run([str(exe), *flags, str(bundle)], capture_output=True, text=True,
                       env=env, timeout=300)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr  # 1: it does not reproduce (a transient)
    assert "reproduces: no" in p.stdout, p.stdout


def _overflow_rows(x: torch.Tensor) -> int:
    """Rows whose fp16-rounded squares sum past 65520 in float64: an RMSNorm's reduction in
    fp16, counted independently of its code."""
    x16 = x.detach().half()
    ss = x16.double().square().half().double().sum(-1)
    return int((torch.isfinite(x16).all(-1) & (ss >= FP16_INF_FROM)).sum())


def _count_norm_inputs(ref: list[dict[str, int]]):
    """A hook on every norm counting its input's overflowing rows, one dict per forward."""

    def plant(model):
        from stabilize.norms import Norm

        norms = [(n, m) for n, m in model.named_modules() if isinstance(m, Norm)]
        first = norms[0][1]

        def count(name):
            def hook(module, args):
                if module.training:
                    if module is first:
                        ref.append({})
                    ref[-1][name] = _overflow_rows(args[0])

            return hook

        for n, m in norms:
            m.register_forward_pre_hook(count(n))

    return plant


def _logged(run_dir: Path, prefix: str) -> dict[int, dict[str, float]]:
    """The per-layer series of each model step, as metrics.csv has them."""
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            vals = {k.split("/", 1)[1]: float(v) for k, v in row.items()
                    if k.startswith(prefix + "/") and v != ""}  # fmt: skip
            if vals and row.get("train/step"):
                out.setdefault(int(float(row["train/step"])), {}).update(vals)
    return out


@pytest.mark.parametrize("kind", ADAPTERS)
def test_overflow_counts_equal_a_float64_count_on_every_step(kind, tmp_path):
    ref: list[dict[str, int]] = []
    run(kind, tmp_path, 6, reduction="fp16", hook=_count_norm_inputs(ref), fault=DRIFT,
        rollback={"enabled": False})  # fmt: skip
    seen = _logged(tmp_path, "overflow")
    assert len(ref) == 6 and sorted(seen) == list(range(1, 7))
    for step, want in enumerate(ref, 1):
        assert seen[step] == {n: float(v) for n, v in want.items()}, (step, seen[step], want)
    assert sum(ref[0].values()) == 0 and sum(ref[-1].values()) > 0  # before and after the drift
    assert any(0 < v < 256 for s in ref for v in s.values())  # rows told apart


@pytest.mark.parametrize("kind", ADAPTERS)
def test_a_deterministic_fault_is_answered_by_the_ladder(kind, tmp_path):
    r = run(kind, tmp_path, 6, reduction="fp16", fault=DRIFT,
            monitor={"activation": {"on_overflow": "rollback"}},
            rollback={"snapshot_every": 2})  # fmt: skip
    (rolled,) = _rollbacks(tmp_path)
    assert rolled["step"] == 5 and rolled["extra"]["class"] == "deterministic"
    assert rolled["extra"]["remedy"] == "fp32_reduction"  # the first rung that changes it
    from stabilize.norms import Norm

    assert {m.reduction_dtype for m in r.model.modules() if isinstance(m, Norm)} == {"fp32"}
    after = [e for e in _events(tmp_path) if e["monitor"] == "overflow" and e["step"] > 5]
    assert after == [] and _finite(r.model)  # the drift goes on; nothing overflows now
    assert math.isfinite(r.model_step) and r.model_step > rolled["extra"]["restored_step"]
