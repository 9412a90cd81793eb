"""What a spike warning can reach (benchmarks/spike_reach.py): threshold rules, the
chance level and their scoring, against hand calculations on recorded-run dicts."""

from __future__ import annotations

from benchmarks import spike_reach as R
from tests.test_spike_forecast import recorded, run_dict


def pre(opt: dict) -> float | None:
    return R.SERIES[0][1](opt)


def test_a_threshold_rule_warns_once_per_horizon_and_is_scored_by_hand():
    # run_dict's quotient is -1 (no point) before step 3, then 0.3 x 1.1^(k - 3) of Adam's
    # line: a threshold at step 8's value is first met at 8, again 40 steps on at 48
    r, calm = run_dict(spike=20, warn_at=10), {**run_dict(None, 10, n=100), "name": "calm"}
    theta = pre(r["steps"][8]["opt"])
    assert R.threshold_warnings(r["steps"], pre, theta, 40) == [8, 48]
    assert R.threshold_warnings(calm["steps"], pre, theta, 40) == [8, 48, 88]
    # 2x the line: 0.3 x 1.1^(k - 3) >= 2 from k - 3 = ln(2 / 0.3) / ln 1.1 = 19.9, step 23
    assert R.threshold_warnings(r["steps"], pre, 2.0, 40) == [23]
    # the spike at 20 is 12 steps after 8: warned at every lead. Verdicts: r's 8 true, 48
    # undetermined (48 + 40 > 59, its last step); calm's 8 and 48 false, 88 undetermined:
    # precision 1 / 3, 2 false warnings in 160 steps = 12.5 per 1,000
    rows = [(r, [20], [8, 48]), (calm, [], [8, 48, 88])]
    assert R.metrics(rows, 40) == [5, "2: 8-8", "1.00", "1.00", "1.00", "0.33", "12.5"]
    # a warning 4 steps ahead counts at leads 1 and 3, not at 5
    assert R.metrics([(r, [20], [16])], 40) == [
        1,
        "1: 16-16",
        "1.00",
        "1.00",
        "0.00",
        "1.00",
        "0.0",
    ]


def test_chance_level_and_percentiles_by_hand():
    r = run_dict(spike=20, warn_at=10)
    assert R.every(r["steps"], 40) == [0, 40]  # steps 0-59
    assert [R.percentile([4.0, 1.0, 3.0, 2.0], p) for p in (50, 90, 99)] == [2.0, 4.0, 4.0]


def test_the_table_names_its_rules_and_the_chance_row_matches_the_hand_count():
    runs = [run_dict(spike=20, warn_at=10), {**run_dict(None, 10, n=100), "name": "calm"}]
    text = R.reach(runs, 40)
    # always: r's warnings at 0 (true: the spike 20 steps on) and 40 (undetermined), calm's
    # at 0 and 40 (false) and 80 (undetermined): the same counts as above
    assert (
        "| always (once per horizon) | - | 5 | 2: 0-0 | 1.00 | 1.00 | 1.00 | 0.33 | 12.5 |" in text
    )
    # the monitor's own forecast warns r at 10 and calm at 10 (run_dict's design), the
    # latter false: precision 0.50, 1 false in 160 steps
    assert (
        "| trend forecast (the monitor's) | - | 2 | 2: 10-10 | 1.00 | 1.00 | 1.00 | 0.50 | 6.2 |"
        in text
    )
    # the clock at 10 warns as the forecast does; at 20, the spike's own step (no lead) in r
    # (undetermined: 20 + 40 > 59) and a false warning in calm
    assert "| clock: step 10 only | - | 2 | 2: 10-10 | 1.00 | 1.00 | 1.00 | 0.50 | 6.2 |" in text
    assert "| clock: step 20 only | - | 2 | 2: 20-20 | 0.00 | 0.00 | 0.00 | 0.00 | 6.2 |" in text
    assert "2 runs (1 unplanted loss spikes" in text and "(p99)" in text
    # under the table, per threshold row: the spike and the row's warnings up to 40 steps
    # before it (the quotient's 99th percentile over both runs is met only at calm's steps
    # past 59; its median, the 80th of the 160 values sorted (six are -1, steps 0-2 of each
    # run, then 0.3 x 1.1^e twice for each e <= 56), is 0.3 x 1.1^36: r warns at step 39,
    # after the spike)
    assert "- curv_pre / Adam's line (p99): r: 20 <- none" in text
    assert "- curv_pre / Adam's line (p50): r: 20 <- none" in text


def test_the_script_writes_the_reach_table_alone_into_its_block(tmp_path):
    import subprocess

    cmd, doc = recorded(tmp_path, "eval_spikes_reach")
    cmd += ["--reach", "--doc", str(doc), "--doc-block", "eval_spikes_reach"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out.startswith("What a warning can reach on these 2 runs")
    assert "spike forecast:" not in out  # the forecast's own tables are not repeated
    text = doc.read_text()
    assert "STALE-BLOCK" not in text and "| clock: step 10 only | - | 2 | 2: 10-10 |" in text
    head = next(line for line in text.splitlines() if line.startswith("Measured by"))
    assert "--reach --doc" in head  # the block names its command
