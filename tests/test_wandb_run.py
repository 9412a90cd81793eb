"""What a W&B run says, read back from its real offline file: one alert per rollback attempt
(W&B holds back a second alert of one title within ``wait_duration``, so the two rollbacks of
one step, the second often the one that fixed it, need two titles), the per-layer maxima
summarised by their peak (the runs table shows a key's summary), and a run name that says
each thing once.

A real run: a persistent NaN loss at step 6, the ladder [skip_data, lower_lr]: both rungs roll
back step 6 to the snapshot at step 4, then the ladder is exhausted and the run aborts. The
run dir is named after the arm, as scripts/repro_nan.sh names it.
"""

from __future__ import annotations

import pytest

from stabilize.run.summary import read_events
from stabilize.stability import StabilityAbort
from stabilize.stability.wandb_layers import PEAKS
from stabilize.train import run
from stabilize.wandb_offline import find_offline_runs, read_offline_run

from conftest import FAST, compose_run

FAULT = 6


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("w") / "large_eps"
    over = [*FAST, "logger=wandb", "arm=large_eps", "trainer.max_steps=8",
            "trainer.val_check_interval=100", "audit.every=0", "fault=nan_loss",
            f"fault.step={FAULT}", "fault.persistent=true", "rollback.snapshot_every=2",
            "rollback.classify=false", "rollback.ladder=[skip_data,lower_lr]",
            "rollback.max_rollbacks=2"]  # fmt: skip
    cfg = compose_run(d, over)
    with pytest.raises(StabilityAbort):
        run(cfg)
    (w,) = find_offline_runs(d / "wandb")
    return cfg, read_events(d), read_offline_run(w, wait_s=30)


def test_each_rollback_of_one_step_gets_its_own_alert_title(wandb_run):
    _, events, w = wandb_run
    rbs = [e for e in events if e["monitor"] == "rollback" and e["kind"] == "rollback"]
    assert [(e["step"], e["extra"]["remedy"]) for e in rbs] == [
        (FAULT, "skip_data"),
        (FAULT, "lower_lr"),
    ]
    titles = [a["title"] for a in w.alerts if a["title"].startswith("rollback at")]
    assert titles == [
        f"rollback at step {FAULT}, attempt 1: skip_data",
        f"rollback at step {FAULT}, attempt 2: lower_lr",
    ]
    assert len({a["title"] for a in w.alerts}) == len(w.alerts)  # none held back as a repeat
    assert all(len(a["title"]) < 64 for a in w.alerts)  # W&B's limit on a title
    assert any(a["title"].startswith("abort") for a in w.alerts)


def test_the_per_layer_maxima_are_summarised_by_their_peak(wandb_run):
    _, _, w = wandb_run
    peaks = {m["name"]: m for m in w.metrics if m["summary"]}
    assert {k: m["summary"] for k, m in peaks.items()} == {f"{p}/*": [h] for p, h in PEAKS.items()}
    for m in peaks.values():
        assert m["glob"] and m["step_metric"] == "trainer/global_step"  # WandbLogger's step
    assert any(k.startswith("act/") for row in w.history for k in row)  # the series it covers


def test_the_run_name_says_each_thing_once(wandb_run):
    cfg, _, w = wandb_run
    # run dir large_eps, arm large_eps: once (it was "<name>-large_eps-large_eps")
    assert w.name == f"{cfg.name}-large_eps"
    assert w.name.split("-").count("large_eps") == 1
