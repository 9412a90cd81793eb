"""Precision bisection over a repro bundle (``stabilize-replay --bisect``): a planted
overflow at one norm is traced to exactly that norm, and a run with the printed per-site
override (``model.norm_sites``) passes the step. The reference is where the fault was
planted: the last block's output, which only ``ln_f`` reads in a pre-norm model. The same
bundle's data bisection (``--data``) respects the run's own class for it, deterministic:
it names a row and writes nothing unless ``--record`` asks."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from stabilize.model import GPT, GPTConfig
from stabilize.replay import main as replay_main
from stabilize.replay.bisect import bisect, override
from stabilize.train import run

from conftest import FAST, compose_run

PLANTED = [
    *FAST, "logger=none", "trainer.max_steps=10", "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100", "rollback.snapshot_every=2",
    "fault=activation_drift", "fault.layer=1", "fault.cross_step=7", "fault.step=3",
    "fault.target_step=null", "fault.channels=1", "norm=rmsnorm", "norm.reduction_dtype=fp16",
    "model.init_std=0.1", "monitor.activation.on_overflow=rollback",
]  # fmt: skip


def _events(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def _overflows(run_dir) -> list[dict]:
    return [e for e in _events(run_dir) if e["monitor"] == "overflow"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The planted run: its overflow at step 7, classed deterministic, and its one bundle."""
    run_dir = tmp_path_factory.mktemp("planted") / "a"
    run(compose_run(run_dir, PLANTED))
    return run_dir


def test_the_bisection_names_the_planted_norm_and_its_override_passes_the_step(planted, tmp_path):
    assert [e["layer"] for e in _overflows(planted)][:1] == ["ln_f"]
    (bundle,) = (planted / "bundles").iterdir()
    b = bisect(bundle)
    assert len(b["sites"]) == 5 and b["failing"]  # ln_1, ln_2 of 2 blocks, and ln_f
    assert b["culprits"] == ["ln_f"]
    assert b["replays"] <= math.ceil(math.log2(len(b["sites"]))) + 3  # one culprit
    fix = override(b["culprits"])
    assert fix == "++model.norm_sites={ln_f:{reduction_dtype:fp32}}"
    # the same run with exactly that site in fp32: the drift reaches the same |x| max, and
    # no reduction overflows at step 7 or after; every other norm still reduces in fp16
    out = run(compose_run(tmp_path / "b", [*PLANTED, fix]))
    assert out["model_step"] == 10 and _overflows(tmp_path / "b") == []
    assert out["ended_with"]["reduction_dtypes"] == ["fp16", "fp32"]


def test_a_site_must_be_a_norm_of_the_model_and_set_only_what_a_site_may():
    with pytest.raises(ValueError, match=r"model.norm_sites.h.9.ln_1 is not allowed: no norm"):
        GPT(GPTConfig(norm_sites={"h.9.ln_1": {"reduction_dtype": "fp32"}}))
    with pytest.raises(ValueError, match="model.norm_sites.ln_f"):
        GPTConfig(norm_sites={"ln_f": {"placement": "post"}})
    site = {"h.0.ln_2": {"reduction_dtype": "fp32", "eps": 1e-3}}
    m = GPT(GPTConfig(norm={"reduction_dtype": "fp16", "backend": "explicit"}, norm_sites=site))
    assert (m.h[0].ln_2.reduction_dtype, m.h[0].ln_2.eps) == ("fp32", 1e-3)
    assert m.h[0].ln_1.reduction_dtype == "fp16" and m.ln_f.reduction_dtype == "fp16"


def test_the_fp32_sites_rung_switches_only_the_norm_that_overflowed(tmp_path):
    """The ladder's fp32_sites: the same planted overflow is answered by switching ln_f
    alone (fp32_reduction switches all 5); the run goes on with no overflow after it, and a
    checkpoint keeps the site so a resume switches it again."""
    out = run(compose_run(tmp_path, [*PLANTED, "rollback.ladder=[fp32_sites]"]))
    evs = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    (rb,) = [e for e in evs if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert rb["extra"]["remedy"] == "fp32_sites" and rb["extra"]["sites"] == ["ln_f"]
    assert rb["extra"]["norms_switched"] == 1
    assert [e["step"] for e in _overflows(tmp_path)] == [7]  # none after the remedy
    assert out["model_step"] == 10 and out["ended_with"]["reduction_dtypes"] == ["fp16", "fp32"]
    import torch

    from stabilize.rollback import reapply_remedies
    from stabilize.rollback.state import TrainState

    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["stabilize"]
    assert saved["fp32_sites"] == ["ln_f"]
    fresh = GPT(GPTConfig(norm={"reduction_dtype": "fp16", "backend": "explicit"}))
    ts = TrainState(fresh)
    ts.load_state_dict(saved, z_loss=0.0)
    reapply_remedies(ts, ts.remedies, {})
    assert fresh.ln_f.reduction_dtype == "fp32" and fresh.h[1].ln_2.reduction_dtype == "fp16"


def test_data_on_a_deterministic_fault_names_the_rows_and_writes_nothing_unless_asked(
    planted, tmp_path, capsys
):
    """The drift overflows ln_f whatever the rows, so the data bisection ends on one row of
    the 4: the run's own re-run called it deterministic (its events), and stabilize-replay
    --data says what it found and leaves the run's skipped_items.json alone; --record writes
    it, as for a data-linked fault; --record without --data is refused."""
    run_dir = tmp_path / "a"  # a copy: what --record writes stays out of the shared run
    shutil.copytree(planted, run_dir)
    (bundle,) = (run_dir / "bundles").iterdir()
    done = [e for e in _events(run_dir) if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert done[0]["extra"]["class"] == "deterministic"  # the live run's verdict
    skipped = run_dir / "skipped_items.json"
    assert not skipped.exists()
    capsys.readouterr()
    assert replay_main(["--data", str(bundle)]) == 1
    head, said = capsys.readouterr().out.strip().splitlines()
    assert head.startswith("data bisection over 4 sequences, ") and "fails with 1 of them" in head
    assert said == (
        "not recorded: the run classed this fault deterministic (the step failed again on the "
        "next micro-batches, replayed from the same weights: the model's state or numerics, not "
        "these sequences); skipping them would change what a resume trains on, not the fault "
        f"(the norms to switch, if any: stabilize-replay --bisect {bundle}; --record records "
        "them anyway)"
    )
    assert not skipped.exists()
    assert replay_main(["--data", "--record", str(bundle)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == head and lines[1].startswith(f"recorded in {skipped}: ")
    (item,) = json.loads(skipped.read_text())["items"]
    assert f"block {item['index']} (hash {item['hash']};" in head
    assert replay_main(["--record", str(bundle)]) == 2
    assert capsys.readouterr().err.startswith("stabilize-replay: --record goes with --data")
