"""Issue 38, "Done when" 3: docs/design-spikes.md's spike drill as written. A gradient spike
with clipping off (x 1000 at step 30) leaves lasting damage in the counterfactual and the
report names the remedy that recovered best; a spike in the loss alone leaves none. The
figures are recomputed here from the runs' own files."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from doc_commands import doc_command

from conftest import run_cli


def _sh(cmd: str, cwd) -> str:
    r = run_cli(["bash", "-c", cmd], cwd=cwd, timeout=900)
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


def _loss(d) -> float:
    return json.loads((d / "final_eval.json").read_text())["loss"]


def _batches(d) -> list[float]:
    return json.loads((d / "final_eval.json").read_text())["batch_loss"]


@pytest.mark.slow  # five runs of 80 steps, five window replays: ~2 minutes
def test_a_gradient_spike_leaves_lasting_damage_and_a_loss_only_spike_none(tmp_path):
    for name in ("spike-refs", "spike-grad", "spike-loss"):
        _sh(doc_command(name), tmp_path)
    runs = tmp_path / "runs"
    refs = [_loss(runs / f"calm-{s}") for s in (1234, 1235, 1236)]
    noise = statistics.stdev(refs) * math.sqrt(4 / 3)  # one more seed's spread, by hand

    out = _sh(doc_command("spike-cf-grad"), tmp_path)
    found = json.loads((runs / "grad-spike" / "gap" / "spike.json").read_text())
    assert found["spike"] == 30 and found["start"] == 20 and found["end"] == 80
    skip = found["branches"]["skip"]
    # the as-happened branch is the run itself and the skip branch the seed-1234 reference
    # (no fault, same seed): the damage by hand, their held-out batches paired
    pairs = zip(_batches(runs / "grad-spike"), _batches(runs / "calm-1234"), strict=True)
    by_hand = statistics.fmean(a - b for a, b in pairs)
    assert skip["gap"] == pytest.approx(by_hand, abs=1e-6)
    assert skip["sigma"] == pytest.approx(by_hand / noise, rel=1e-6)
    assert skip["lasting"] is True and skip["sigma"] > 4.303  # outside the 3-seed band
    line = next(x for x in out.splitlines() if x.startswith("  skip ("))
    assert f"{skip['gap']:+.4f}" in line and ": lasting damage;" in line
    assert found["branches"]["clip"]["gap"] > 0  # clipping would have saved most of it too
    # the lower_lr rung took effect: a rollback past the spike at half the LR trains slower
    # than the same rollback at the schedule's LR (skip), and still beats the spike
    lower = found["branches"]["lower_lr"]
    assert 0 < lower["gap"] < skip["gap"]
    assert out.splitlines()[-1].startswith("best remedy: skip")

    out = _sh(doc_command("spike-cf-loss"), tmp_path)
    found = json.loads((runs / "loss-spike" / "gap" / "spike.json").read_text())
    skip = found["branches"]["skip"]
    assert skip["gap"] == 0.0 and skip["lasting"] is False and skip["back_after"] == 0
    assert _loss(runs / "loss-spike") == refs[0]  # the weights never saw the spike
    line = next(x for x in out.splitlines() if x.startswith("  skip ("))
    assert "+0.0000 +- 0.0000 nats" in line and ": no lasting damage;" in line


def test_bad_spike_arguments_are_refused_in_one_line(tmp_path, capsys):
    from stabilize.replay.cli import main

    (tmp_path / "run").mkdir()
    for argv, said in (
        ([str(tmp_path / "run"), "--spike"], "not a run dir (no config.json)"),
        ([str(tmp_path / "run"), "--spike", "--steps", "0"], "--steps=0 is not allowed"),
        ([str(tmp_path / "run"), "--spike", "--at", "0"], "--at=0 is not allowed"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / "gap").exists()  # nothing written


@pytest.mark.slow  # three runs of 40 steps and four window replays: ~1.5 minutes
def test_a_spike_no_fault_planted_is_skipped_as_a_resume_with_its_batch_skipped_would(tmp_path):
    """The skip branch of a spike no fault planted (``--at``) never trains on the spike's
    batch. Its independent reference: the same run stopped at the window's start and
    resumed by the harness's own resume path with that batch's data position in
    ``skipped_batches.json`` (the skip_batch rung's file). The damage by hand from the two
    runs' held-out batches is the counterfactual's, to 1e-6; lower_lr and clip run too."""
    common = ("stabilize-train experiment=main precision=fp32 trainer.max_steps=40 "
              "optim.lr=1e-3 rollback.enabled=false trainer.checkpoint_every_n_steps=10 "
              "logger=none seed=1234")  # fmt: skip
    _sh(f"{common} run_dir=runs/calm", tmp_path)
    _sh(f"{common} trainer.stop_at_step=20 run_dir=runs/ref", tmp_path)
    ref = tmp_path / "runs" / "ref"
    # step 25 is the 5th after the checkpoint at 20: one micro-batch a step, data position 24
    (ref / "skipped_batches.json").write_text(json.dumps({"batches": [{"data_step": 24}]}))
    _sh(f"{common} resume=auto run_dir=runs/ref", tmp_path)
    out = _sh("stabilize-replay --spike runs/calm --at 25 --steps 15", tmp_path)
    found = json.loads((tmp_path / "runs" / "calm" / "gap" / "spike.json").read_text())
    assert found["planted"] is False and found["start"] == 20 and found["end"] == 40
    skip = found["branches"]["skip"]
    assert skip["skipped_data_steps"] == [24]
    pairs = zip(_batches(tmp_path / "runs" / "calm"), _batches(ref), strict=True)
    by_hand = statistics.fmean(a - b for a, b in pairs)
    assert by_hand != 0.0 and skip["gap"] == pytest.approx(by_hand, abs=1e-6)
    assert set(found["branches"]) == {"skip", "clip", "lower_lr"}
    assert found["branches"]["lower_lr"]["gap"] != 0.0  # the rung took effect
    assert "skip (the spike's batch skipped, the skip_batch rung)" in out
