"""The NaN scenario end to end: every arm of configs/experiment/nan_repro.yaml, shortened
(the drift starts at step 10 and crosses 256 at step 25, 50 steps in all), trained for real
with W&B offline files; then the report is read back from those run directories.

The full-length scenario (scripts/repro_nan.sh, ~1 min per arm) is the `slow` case at the end.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from stabilize.report import load_run_dir, main, summarize, write_report
from stabilize.report.load import events_from_rows
from stabilize.report.rollbacks import rollbacks
from stabilize.train import run
from stabilize.wandb_offline import find_offline_runs, read_offline_run

from conftest import ROOT, compose_run, run_cli

ARMS = ["baseline", "fp32_reduction", "bf16", "large_eps", "remedy"]
CROSS, START, STEPS = 25, 10, 50
SHORT = [
    "experiment=nan_repro",
    f"trainer.max_steps={STEPS}",
    f"fault.step={START}",
    f"fault.cross_step={CROSS}",
    "trainer.log_every_n_steps=1",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=2",
    f"trainer.checkpoint_every_n_steps={STEPS}",
    "trainer.progress=none",
    "audit.every=5",
    "data.batch_size=4",
]


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan_repro")
    dirs = {}
    for arm in ARMS:
        d = root / arm
        try:
            run(compose_run(d, [*SHORT, f"arm={arm}"]))
        except Exception as e:  # an arm may stop (e.g. an abort): the report says so
            (d / "crash.txt").write_text(repr(e))
        dirs[arm] = d
    return dirs


def events(d, monitor=None):
    evs = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return [e for e in evs if monitor is None or e["monitor"] == monitor]


def act(d, layer="h.0"):
    """{model step: |x| max after block 0}, from the CSV log (every step here)."""
    r = load_run_dir(d)
    return {int(row["train/step"]): row[f"act/{layer}"] for row in r.rows if f"act/{layer}" in row}


def test_baseline_overflows_exactly_at_the_configured_step_and_the_chain_is_recorded(arms):
    d = arms["baseline"]
    assert not (d / "crash.txt").exists()
    a = act(d)
    assert a[CROSS - 1] < 256 < a[CROSS]  # the drift crosses the line on the chosen step
    over = events(d, "overflow")
    assert over and over[0]["step"] == CROSS  # ... and the first overflow is there, not before
    assert over[0]["extra"]["collapsed"] > 0  # its rows came out as zeros: dead tokens
    evs = events(d)
    warn = next(i for i, e in enumerate(evs) if e["monitor"] == "activation")
    first_over = next(i for i, e in enumerate(evs) if e["monitor"] == "overflow")
    assert evs[warn]["step"] == CROSS and warn < first_over  # the 256 warning is logged first
    # The NaN is a later link: it comes when the residual itself passes fp16's max (its cast
    # to fp16 in the next norm is inf, and inf * rsqrt(inf) = inf * 0 = NaN), not at the overflow
    nan = events(d, "nonfinite")
    assert nan, "no non-finite value recorded"
    first_past_max = min(s for s, v in a.items() if not v < 65504)
    assert nan[0]["step"] == first_past_max > CROSS
    # eps 1e-5: the fp16 reduction's backward overflows at init (embeddings' RMS ~0.03), so
    # the GradScaler skips every step before the drift: measured, not assumed
    skips = {e["step"] for e in events(d, "loss_scale") if e["kind"] == "skip"}
    assert set(range(1, START)) <= skips
    audits = [json.loads(x) for x in (d / "audit.jsonl").read_text().splitlines()]
    assert all(x["dead_share"] == 0 for x in audits if x["step"] < CROSS)
    assert any(x["dead_share"] > 0 for x in audits if x["step"] >= CROSS)


def test_fp32_reduction_has_no_overflow_and_no_dead_token_under_the_same_drift(arms):
    d = arms["fp32_reduction"]
    a = act(d)
    assert a[CROSS - 1] < 256 < a[CROSS] and max(a.values()) > 65504  # the same drift
    assert events(d, "overflow") == [] and events(d, "nonfinite") == []
    audits = [json.loads(x) for x in (d / "audit.jsonl").read_text().splitlines()]
    assert audits and all(x["dead_share"] == 0 and x["nonfinite_share"] == 0 for x in audits)
    assert json.loads((d / "result.json").read_text())["status"] == "done"


def test_bf16_survives_but_pays_in_precision(arms):
    bf, fp = summarize(load_run_dir(arms["bf16"])), summarize(load_run_dir(arms["fp32_reduction"]))
    assert bf.first_overflow is None and bf.first_nonfinite is None
    # 8 significant bits against fp16's 11: outputs rounded ~8x coarser
    assert bf.rel_err > 3 * fp.rel_err, (bf.rel_err, fp.rel_err)
    assert 2**-12 < bf.rel_err < 2**-6


def test_large_eps_lets_training_start_but_does_not_rescue_the_overflowed_sum(arms):
    eps, base = (
        summarize(load_run_dir(arms["large_eps"])),
        summarize(load_run_dir(arms["baseline"])),
    )
    assert eps.eps == 1e-3 and base.eps == 1e-5
    assert base.early_skip_share == 1.0 and base.never_trained
    assert eps.early_skip_share < 0.5 and not eps.never_trained
    assert eps.first_overflow == CROSS and eps.dead_tokens > 0  # inf + eps is still inf
    assert eps.first_nonfinite is not None


def test_remedy_answers_the_drift_and_says_what_each_rung_changed(arms):
    d = arms["remedy"]
    s = summarize(load_run_dir(d))
    assert s.status == "done" and s.steps == STEPS
    # eps 1e-3: no init-time backward overflow, so every rollback answers the drift's overflow
    rbs = rollbacks(events(d))
    # the replay finds the drift again on the next batch: deterministic, the numerics rungs
    assert [rb.remedy for rb in rbs] == ["lower_lr", "fp32_reduction"]
    assert all(rb.step == CROSS and rb.answered[0].startswith(f"overflow@{CROSS}") for rb in rbs)
    last_rb = max(e["global_step"] for e in events(d, "rollback") if e["kind"] == "rollback")
    assert [e for e in events(d, "overflow") if e["global_step"] > last_rb] == []
    # one audit per model step, never of the initial weights: a rollback rewinds the step
    # to its snapshot's, whose state was audited already
    steps = [json.loads(x)["step"] for x in (d / "audit.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps)) and min(steps) > 0, steps
    assert [e for e in events(d, "nonfinite") if e["global_step"] > last_rb] == []
    assert math.isfinite(s.final_loss) and s.heldout_bpb is not None
    assert "for the rest of the run" in s.rollback_story[0]
    assert "reduce in fp32 from here on" in s.rollback_story[1]


def test_arms_share_one_wandb_group_with_the_same_metric_names(arms):
    groups, keys = set(), []
    for arm in ARMS:
        w = read_offline_run(find_offline_runs(arms[arm] / "wandb")[-1], wait_s=30)
        groups.add(w.group)
        assert w.config["arm"] == arm
        keys.append({k for row in w.history for k in row})
    assert groups == {"nan_repro"}
    common = set.intersection(*keys)
    for k in ("train/loss", "train/grad_norm", "train/step", "act/h.0", "audit/rel_err_median"):
        assert k in common, k


def test_report_table_plots_and_conclusions_match_the_runs(arms, tmp_path):
    runs = [load_run_dir(arms[a]) for a in ARMS]
    report = write_report(runs, tmp_path, "nan_repro (short)")
    text = report.read_text()
    sums = {r.arm: summarize(r) for r in runs}
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(ARMS)
    # the first-overflow cell, against what the drift was set to do (the remedy arm's own
    # course is tested above)
    known = {"baseline": CROSS, "large_eps": CROSS, "fp32_reduction": "never", "bf16": "never"}
    for arm, first_overflow in known.items():
        row = next(line for line in table if line.startswith(f"| {arm} |"))
        assert row.split(" | ")[4] == str(first_overflow), row
    for png in ("loss", "act_max", "loss_scale", "audit", "grad_norm"):
        p = tmp_path / f"{png}.png"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert f"({png}.png)" in text
    conclusions = text.split("## Conclusions")[1].split("## Plots")[0]
    base = sums["baseline"]
    assert f"preceded the first NaN by {base.warning_lead} steps" in conclusions
    assert base.warning_lead == base.first_nonfinite - base.first_over_line > 0
    assert "fp32_reduction fixes it" in conclusions and "bf16 fixes it" in conclusions
    assert "large_eps does not fix it" in conclusions and "baseline never trained" in conclusions
    assert f"remedy recovered through {sums['remedy'].rollbacks} rollback" in conclusions
    rolled = text.split("## Rollbacks")[1].split("## Plots")[0]
    assert "### remedy" in rolled and "LR x0.5 for the rest of the run" in rolled
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [s["arm"] for s in saved] == ARMS


def test_report_reads_wandb_offline_files_and_rebuilds_events_from_metrics(arms, tmp_path):
    src = arms["baseline"]
    d = tmp_path / "baseline"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("csv", "checkpoints"))
    from_wandb, from_csv = load_run_dir(d), load_run_dir(src)
    assert from_wandb.source.startswith("wandb-offline")

    def same(series):  # NaN losses are part of the story: compare them as NaN
        return [(x, "nan" if math.isnan(v) else v) for x, v in series]

    assert same(from_wandb.series("train/loss")) == same(from_csv.series("train/loss"))
    rebuilt = events_from_rows(from_csv.rows)  # as from the W&B API: metrics only
    first = next(e for e in rebuilt if e["monitor"] == "overflow")
    assert first["step"] == CROSS  # logged every step here, so as exact as the events file
    assert (
        next(e for e in rebuilt if e["monitor"] == "nonfinite")["step"]
        == next(e for e in events(src) if e["monitor"] == "nonfinite")["step"]
    )


def test_report_cli(arms, tmp_path, capsys):
    assert main([str(arms["baseline"]), str(arms["remedy"]), "--out", str(tmp_path)]) == 0
    assert f"report: {tmp_path / 'report.md'}" in capsys.readouterr().out
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    r = run_cli([sys.executable, "-m", "stabilize.report", "--wandb", "me/proj"], cwd=tmp_path)
    assert r.returncode == 2 and "--group" in r.stderr


@pytest.mark.slow  # 64 s on 2 idle cores; multi-rank rollback is also covered by the
# default suite's torchrun tests (test_stability, test_two_nodes, test_accumulation)
def test_repro_nan_script_with_two_torchrun_ranks(tmp_path):
    """The scenario script end to end, shortened, each arm a 2-rank torchrun (gloo)."""
    out = tmp_path / "ddp"
    script = str(ROOT / "scripts" / "repro_nan.sh")
    short = ["trainer.max_steps=40", f"fault.step={START}", f"fault.cross_step={CROSS}"]
    args = ["bash", script, "--arms", "baseline,remedy", "--nproc-per-node", "2", "--out"]
    r = run_cli([*args, str(out), "--", *short, "data.batch_size=4"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"report: {out}/report.md" in r.stderr
    # each arm's progress streamed as it ran, prefixed with the arm (issue 16, item 3)
    for arm in ("baseline", "remedy"):
        assert f"    {arm} | step 40/40  " in r.stderr, r.stderr[-3000:]
        assert f"    {arm} | done: 40 steps (40 asked" in r.stderr
    base, remedy = (summarize(load_run_dir(out / a)) for a in ("baseline", "remedy"))
    assert base.first_overflow == CROSS and base.first_nonfinite is not None
    assert base.nonfinite_where.startswith("h.1.ln_1")  # localized on every rank, agreed
    assert remedy.rollbacks >= 1 and remedy.remedies[-1] == "fp32_reduction"
    assert remedy.status == "done" and remedy.first_overflow is None
    for arm in ("baseline", "remedy"):
        replicas = json.loads((out / arm / "replicas.json").read_text())
        assert replicas["world_size"] == 2 and replicas["identical"]


@pytest.mark.slow
def test_repro_nan_script_runs_every_arm_and_writes_the_report(tmp_path):
    out = tmp_path / "nan_repro"
    r = run_cli(
        ["bash", str(ROOT / "scripts" / "repro_nan.sh"), "--out", str(out)],
        cwd=tmp_path,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{out}/report.md" in r.stderr
    text = (out / "report.md").read_text()
    for arm in ARMS:
        assert f"| {arm} |" in text
    base = summarize(load_run_dir(out / "baseline"))
    assert base.first_overflow == 80 and base.first_forecast is not None
    assert base.first_forecast < base.first_over_line


def test_scenario_script_help():
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "repro_nan.sh"), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--arms" in r.stdout
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "repro_nan.sh"), "--bogus"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr


def test_scenario_script_refuses_unknown_arms_and_used_dirs(tmp_path):
    script = str(ROOT / "scripts" / "repro_nan.sh")
    r = run_cli(["bash", script, "--arms", "baseline,nope", "--out", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 2 and "arm 'nope' is not allowed; allowed: baseline," in r.stderr
    (tmp_path / "remedy").mkdir()
    (tmp_path / "remedy" / "events.jsonl").write_text("")
    r = run_cli(["bash", script, "--arms", "remedy", "--out", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 2 and "already holds a run" in r.stderr


def test_conclusions_follow_the_numbers_when_the_baseline_never_trains():
    """The natural scenario's outcome (measured with scripts/repro_nan.sh --experiment
    nan_repro_natural): the baseline skipped every step, large eps overflowed with no NaN."""
    from stabilize.report.summary import ArmSummary, conclusions

    base = ArmSummary("baseline", "b", "done", precision="fp16-mixed", early_skip_share=1.0)
    base.min_loss_scale, base.steps = 0.0, 400
    eps = ArmSummary("large_eps", "e", "done", precision="fp16-mixed", early_skip_share=0.0)
    eps.first_overflow, eps.dead_tokens, eps.final_loss = 8, 10.0, 5.55
    fp32 = ArmSummary("fp32_reduction", "f", "done", precision="fp16-mixed", rel_err=3.5e-4)
    text = "\n".join(conclusions([base, eps, fp32]))
    assert "baseline never trained: the GradScaler skipped 100%" in text
    assert "baseline fixes it" not in text and "fp32_reduction fixes it" in text
    assert "large_eps does not fix it: it overflowed at step 8" in text
    assert "never went non-finite (final loss 5.55)" in text
    assert "like the baseline" not in text  # the baseline did not overflow
    assert "It does let training start" in text
