"""W&B alerts: one per episode, as the console prints one line (issue 34, item 6).

Online, each alert is an e-mail or a Slack message; a 120-step baseline sent 327. A real
Lightning run with W&B offline whose norm overflows on every step; the alerts are read back
from the offline run file and counted against the episodes counted by hand from
events.jsonl (events of one kind and monitor within 25 steps of each other are one; the
controller's own are one each).
"""

from __future__ import annotations

from stabilize.run.summary import read_events
from stabilize.train import run
from stabilize.wandb_offline import find_offline_runs, read_offline_run
from tests.conftest import FAST, compose_run

GAP = 25  # the console's episode gap (docs/monitors.md), restated as the reference


def episodes(events: list[dict]) -> list[dict]:
    """The first event of each episode, by hand."""
    last: dict[tuple, int] = {}
    firsts = []
    for e in events:
        if e["kind"] == "info":
            continue
        if e["monitor"] == "rollback" or e["kind"] == "abort":
            firsts.append(e)
            continue
        key = (e["kind"], e["monitor"])
        if key not in last or abs(e["step"] - last[key]) > GAP:
            firsts.append(e)
        last[key] = e["step"] if key not in last else max(last[key], e["step"])
    return firsts


def test_a_norm_overflowing_every_step_sends_one_alert(tmp_path):
    """The scenario's drift, compressed: from step 2 the residual stream grows to 1e4 by
    step 6 and holds, so the fp16 reduction overflows on every step after (fp32 autocast:
    the norm reduces in fp16 all the same, and the run is fast on a CPU)."""
    steps = 12
    over = ["experiment=nan_repro", *FAST, f"trainer.max_steps={steps}", "logger=wandb",
            "precision=fp32", "fault.step=2", "fault.target_step=6",
            "trainer.val_check_interval=100", "audit.every=0"]  # fmt: skip
    run(compose_run(tmp_path, over))
    evs = read_events(tmp_path)
    overflows = [e for e in evs if e["kind"] == "warn" and e["monitor"] == "overflow"]
    assert len(overflows) >= 6, [(e["monitor"], e["step"]) for e in evs]
    (w,) = find_offline_runs(tmp_path / "wandb")
    alerts = read_offline_run(w, wait_s=30).alerts
    want = [e for e in episodes(evs) if e["kind"] in ("warn", "rollback", "abort")]
    assert len(alerts) == len(want) < len(overflows), (alerts, want)
    assert sum("overflow" in a["title"] for a in alerts) == 1
