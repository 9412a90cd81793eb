"""The NaN scenario end to end: the healthy reference (two seeds) and every arm of
configs/experiment/nan_repro.yaml, shortened (the stream drift starts at step 8 and reaches
1e4 at step 20, 40 steps in all), trained for real with W&B offline files; then the report
is read back from those run directories and its verdicts held against their numbers.

The full-length scenario (scripts/repro_nan.sh) is the `slow` case at the end.
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
REF_SEEDS = (1234, 1235)  # the healthy reference, twice: a seed band to judge gaps by
START, TARGET, STEPS = 8, 20, 40
D = 128  # the tiny GPT's width: an fp16 sum of D squares overflows once a row's RMS > LINE
LINE = (65504 / D) ** 0.5  # 22.62, by hand
SHORT = [
    "experiment=nan_repro",
    f"trainer.max_steps={STEPS}",
    f"fault.step={START}",
    f"fault.target_step={TARGET}",
    "trainer.log_every_n_steps=1",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=2",
    f"trainer.checkpoint_every_n_steps={STEPS}",
    "trainer.progress=none",
    "audit.every=5",
    "data.batch_size=4",
    "trainer.final_eval_batches=8",  # fp16 forwards are slow on CPU: part of the split
    # a bundle of each monitor's first verdict (rollback off), of every verdict (on), kept:
    # the first scaler skip's bundle is replayed against the live name
    "rollback.bundle=always",
    "rollback.bundle_keep=-1",
]


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    root = tmp_path_factory.mktemp("nan_repro")
    dirs = {}
    plan = [(f"reference-seed{s}", "reference", s) for s in REF_SEEDS]
    plan += [(a, a, REF_SEEDS[0]) for a in ARMS]
    for name, arm, seed in plan:
        d = root / name
        try:
            run(compose_run(d, [*SHORT, f"arm={arm}", f"seed={seed}"]))
        except Exception as e:  # an arm may stop (e.g. an abort): the report says so
            (d / "crash.txt").write_text(repr(e))
        dirs[name] = d
    dirs["reference"] = dirs[f"reference-seed{REF_SEEDS[0]}"]
    return dirs


def events(d, monitor=None):
    evs = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return [e for e in evs if monitor is None or e["monitor"] == monitor]


def metric(d, key):
    """{model step: value} from the CSV log (every step here)."""
    r = load_run_dir(d)
    return {int(row["train/step"]): row[key] for row in r.rows if key in row}


def act(d, layer="h.0"):
    return metric(d, f"act/{layer}")


NORMS = ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"]


def test_baseline_trains_like_the_reference_then_overflows_in_the_forward_then_nan(arms):
    d, ref = arms["baseline"], arms["reference"]
    assert not (d / "crash.txt").exists()
    # until the drift, the baseline IS the reference (same seed, no init-time failure):
    # bit-identical losses, the same loss-scale calibration skips
    loss, ref_loss = metric(d, "train/loss"), metric(ref, "train/loss")
    assert all(loss[s] == ref_loss[s] for s in range(1, START)), (loss, ref_loss)
    assert loss[START - 1] < loss[1] - 0.5  # and it was learning
    over = events(d, "overflow")
    assert over and over[0]["step"] > START
    first = over[0]["step"]
    # the forward overflow, against the hand-computed line: a row's fp16 sum of squares
    # passes 65504 once its RMS passes sqrt(65504 / 128) = 22.62. Every norm input was below
    # it the step before; at the first overflow one was past it, or its fp16 statistic was
    # inf (a non-finite RMS is not logged), and that norm is the one the event names
    rms = {n: metric(d, f"rms/{n}") for n in NORMS}
    assert max(rms[n][first - 1] for n in NORMS) < LINE
    past = {n for n in NORMS if first not in rms[n] or rms[n][first] > LINE}
    assert past and over[0]["layer"] in past, (past, over[0])
    assert over[0]["extra"]["collapsed"] > 0  # its rows came out as zeros: dead tokens
    assert max(act(d).values()) < 65504  # the drift levels off at the seed's ~1e4
    # the gradients go non-finite only after the overflow (a GradScaler skip at or after it)
    s = summarize(load_run_dir(d))
    assert s.first_grad_nonfinite is not None and s.first_grad_nonfinite >= first
    ref_skips = {e["step"] for e in events(ref, "loss_scale") if e["kind"] == "skip"}
    skips = {e["step"] for e in events(d, "loss_scale") if e["kind"] == "skip"}
    assert {x for x in skips if x < first} == {x for x in ref_skips if x < first}
    audits = [json.loads(x) for x in (d / "audit.jsonl").read_text().splitlines()]
    assert all(x["dead_share"] == 0 for x in audits if x["step"] < first)
    assert any(x["dead_share"] > 0 for x in audits if x["step"] >= first)


def test_fp32_reduction_has_no_overflow_and_trains_like_the_reference(arms):
    d = arms["fp32_reduction"]
    a = act(d)
    assert max(a[s] for s in range(1, START)) < 256 < max(a.values())  # the same drift
    assert events(d, "overflow") == [] and events(d, "nonfinite") == []
    audits = [json.loads(x) for x in (d / "audit.jsonl").read_text().splitlines()]
    assert audits and all(x["dead_share"] == 0 and x["nonfinite_share"] == 0 for x in audits)
    assert json.loads((d / "result.json").read_text())["status"] == "done"
    # the drift is invisible to a 32-bit reduction: its training gap to the reference (same
    # seed) is smaller than a change of the reference's seed; the baseline's is far larger
    final = {a: summarize(load_run_dir(arms[a])).final_loss for a in arms}
    seeds = abs(final["reference-seed1234"] - final["reference-seed1235"])
    gap = abs(final["fp32_reduction"] - final["reference"])
    assert gap < seeds < (final["baseline"] - final["reference"]) / 3, (gap, seeds, final)


def test_bf16_survives_but_pays_in_precision_at_the_drifts_magnitude(arms):
    bf, fp = summarize(load_run_dir(arms["bf16"])), summarize(load_run_dir(arms["fp32_reduction"]))
    assert bf.first_overflow is None and bf.first_nonfinite is None
    # 8 significant bits against fp16's 11: outputs rounded ~8x coarser
    assert bf.rel_err > 3 * fp.rel_err, (bf.rel_err, fp.rel_err)
    assert 2**-12 < bf.rel_err < 2**-6
    audits = [json.loads(x) for x in (arms["bf16"] / "audit.jsonl").read_text().splitlines()]
    drifted = [x["rel_err_median"] for x in audits if x["step"] >= TARGET]
    assert drifted and all(2**-12 < e < 2**-6 for e in drifted)


def test_large_eps_does_not_rescue_the_overflowed_sum_and_flattens_small_rows(arms):
    eps, base = (
        summarize(load_run_dir(arms["large_eps"])),
        summarize(load_run_dir(arms["baseline"])),
    )
    assert eps.eps == 1e-3 and base.eps == 1e-5
    assert not base.never_trained and not eps.never_trained
    assert eps.first_overflow == base.first_overflow and eps.dead_tokens > 0  # inf + eps = inf
    assert eps.first_grad_nonfinite is not None
    assert eps.flattened > 0 and (base.flattened or 0) == 0  # what eps 1e-3 does before it


def test_remedy_answers_the_overflow_and_says_what_each_rung_changed(arms):
    d = arms["remedy"]
    s = summarize(load_run_dir(d))
    assert s.status == "done" and s.steps == STEPS
    rbs = rollbacks(events(d))
    first = events(arms["baseline"], "overflow")[0]["step"]
    assert rbs and all(rb.answered[0].startswith(f"overflow@{first}") for rb in rbs)
    assert rbs[-1].remedy == "fp32_reduction"
    last_rb = max(e["global_step"] for e in events(d, "rollback") if e["kind"] == "rollback")
    assert [e for e in events(d, "overflow") if e["global_step"] > last_rb] == []
    # one audit per model step, never of the initial weights: a rollback rewinds the step
    # to its snapshot's, whose state was audited already
    steps = [json.loads(x)["step"] for x in (d / "audit.jsonl").read_text().splitlines()]
    assert len(steps) == len(set(steps)) and min(steps) > 0, steps
    assert [e for e in events(d, "nonfinite") if e["global_step"] > last_rb] == []
    assert math.isfinite(s.final_loss) and s.heldout_bpb is not None
    assert "reduce in fp32 from here on" in s.rollback_story[-1]


def test_every_arms_live_name_for_its_first_scaler_skip_is_the_replays(arms):
    """Issue 34: the console named lm_head in every fp16 arm (the references too), the
    replay of the same step a norm. Each arm's first step with a non-finite gradient, its
    name in events.jsonl against stabilize-replay's on that step's bundle."""
    from stabilize.replay.core import replay

    compared = 0
    for name, d in arms.items():
        if name == "reference":  # an alias of reference-seed1234
            continue
        hit = [e for e in events(d) if (e.get("extra") or {}).get("grad_scan")]
        if not hit:
            continue
        first = hit[0]
        live = first["extra"]["grad_scan"]
        assert live["found_by"] == "rerun" and live["grad_module"] != "lm_head", (name, live)
        (bundle,) = sorted((d / "bundles").glob(f"step-{first['step']:06d}-*"))[:1]
        out = replay(bundle)
        assert out["backward"]["grad_module"] == live["grad_module"], (name, out["backward"])
        compared += 1
    assert compared >= 3, compared  # the references skip too (fp16 loss scaling)


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


def test_report_table_verdicts_and_conclusions_match_the_runs(arms, tmp_path):
    names = [f"reference-seed{x}" for x in REF_SEEDS] + ARMS
    runs = [load_run_dir(arms[a]) for a in names]
    report = write_report(runs, tmp_path, "nan_repro (short)")
    text = report.read_text()
    table = [line for line in text.split("## Against")[0].splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(names)
    assert table[1].startswith("| reference seed 1234 |") and table[2].startswith(
        "| reference seed 1235 |"
    )
    first = events(arms["baseline"], "overflow")[0]["step"]
    known = {"baseline": first, "large_eps": first, "fp32_reduction": "never", "bf16": "never"}
    for arm, first_overflow in known.items():
        row = next(line for line in table if line.startswith(f"| {arm} |"))
        assert row.split(" | ")[4] == str(first_overflow), row
    for png in ("loss", "act_max", "loss_scale", "audit", "grad_norm"):
        p = tmp_path / f"{png}.png"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert f"({png}.png)" in text
    # the verdict table against independent arithmetic on the runs' own files
    held = {a: json.loads((arms[a] / "final_eval.json").read_text())["bpb"] for a in names}
    ref_mean = sum(held[f"reference-seed{x}"] for x in REF_SEEDS) / len(REF_SEEDS)
    verdicts = text.split("## Against the reference")[1].split("## Conclusions")[0]
    rows = {r.split(" | ")[0].strip("| "): r.split(" | ") for r in verdicts.splitlines()[4:]
            if r.startswith("| ")}  # fmt: skip
    conclusions = text.split("## Conclusions")[1].split("## Rollbacks")[0]
    for arm in ARMS:
        cells = rows[arm]
        assert float(cells[3]) == pytest.approx(held[arm] - ref_mean, abs=6e-4), (arm, cells)
        stopped, inside, label = cells[1] == "yes", cells[5] == "yes", cells[-1].strip(" |")
        # every verdict's words follow from its row: a model at ln 256 (a uniform guess) dies
        final = summarize(load_run_dir(arms[arm])).final_loss
        dies = abs(final - math.log(256)) <= 0.01 * math.log(256)
        assert label.startswith("dies") == dies, (cells, final)
        assert (label == "fixes it") == (stopped and inside and not dies), cells
        assert (label == "does not stop the NaN") == (not stopped and not dies), cells
        sentence = next(c for c in conclusions.splitlines() if c.startswith(f"- {arm} "))
        if dies:
            assert f"{arm} dies: " in sentence and "predicts uniformly" in sentence
        elif label == "fixes it":
            assert f"{arm} fixes it: no NaN" in sentence
        elif stopped:
            assert f"{arm} stops the NaN" in sentence and "fixes it" not in sentence
        else:
            assert f"{arm} does not stop the NaN" in sentence
    assert rows["baseline"][1] == "no" and rows["fp32_reduction"][1] == "yes"
    assert "Baseline chain (in step order): " in conclusions
    assert f"step {first}: the first fp16 reduction overflowed" in conclusions
    rolled = text.split("## Rollbacks")[1].split("## Plots")[0]
    assert "### remedy" in rolled and "reduce in fp32 from here on" in rolled
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [s["arm"] for s in saved] == ["reference seed 1234", "reference seed 1235", *ARMS]


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
    # logged every step here, so as exact as the events file
    assert first["step"] == events(src, "overflow")[0]["step"]


def test_report_cli(arms, tmp_path, capsys):
    assert main([str(arms["baseline"]), str(arms["remedy"]), "--out", str(tmp_path)]) == 0
    assert f"report: {tmp_path / 'report.md'}" in capsys.readouterr().out
    assert main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["--wandb", "me/proj"])
    assert e.value.code == 2 and "--group" in capsys.readouterr().err


def test_the_gap_command_on_the_arms_says_two_seeds_cannot_measure_noise(arms, tmp_path, capsys):
    """``stabilize-gap`` (report/gap.py) on real run dirs: the bf16 arm against the two
    reference seeds. Its gaps are the held-out and last-steps differences computed here
    from the runs' own files; with 2 seeds it gives no sigma and says why (exit 1)."""
    from stabilize.report.gap_cli import main as gap_main
    from stabilize.report.summary import last_steps_mean

    refs = [arms[f"reference-seed{s}"] for s in REF_SEEDS]
    rc = gap_main([str(arms["bf16"]), "--reference", *map(str, refs), "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1, out

    def heldout(d):
        return json.loads((d / "final_eval.json").read_text())["loss"]

    def last(d):
        return last_steps_mean(sorted(metric(d, "train/loss").items()))

    want = heldout(arms["bf16"]) - sum(map(heldout, refs)) / 2
    assert out[1] == (f"  held-out loss {want:+.4f} nats: 2 reference seeds, at least 3 are "
                      "needed to measure seed noise")  # fmt: skip
    want_last = last(arms["bf16"]) - sum(map(last, refs)) / 2
    assert out[2].startswith(f"  last-steps loss {want_last:+.4f} nats: 2 reference seeds")
    saved = json.loads((tmp_path / "gap.json").read_text())
    assert saved["gap"] == pytest.approx(want) and saved["sigma"] is None
    assert saved["real"] is None and (tmp_path / "gap.png").stat().st_size > 10_000
    assert gap_main([str(tmp_path / "nope"), "--reference", str(refs[0])]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow  # 64 s on 2 idle cores; multi-rank rollback is also covered by the
# default suite's torchrun tests (test_stability, test_two_nodes, test_accumulation)
def test_repro_nan_script_with_two_torchrun_ranks(tmp_path):
    """The scenario script end to end, shortened, each arm a 2-rank torchrun (gloo)."""
    out = tmp_path / "ddp"
    script = str(ROOT / "scripts" / "repro_nan.sh")
    short = ["trainer.max_steps=40", f"fault.step={START}", f"fault.target_step={TARGET}"]
    args = ["bash", script, "--arms", "baseline,remedy", "--nproc-per-node", "2", "--out"]
    r = run_cli([*args, str(out), "--", *short, "data.batch_size=4"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"report: {out}/report.md" in r.stderr
    # each arm's progress streamed as it ran, prefixed with the arm
    for arm in ("baseline", "remedy"):
        assert f"    {arm} | step 40/40  " in r.stderr, r.stderr[-3000:]
        assert f"    {arm} | done: 40 steps (40 asked" in r.stderr
    base, remedy = (summarize(load_run_dir(out / a)) for a in ("baseline", "remedy"))
    assert base.first_overflow > START and base.first_grad_nonfinite >= base.first_overflow
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
    assert "plan: 8 runs" in r.stderr and "scenario done in" in r.stderr
    text = (out / "report.md").read_text()
    for arm in ARMS:
        assert f"| {arm} |" in text
    assert "| reference (3 seeds) |" in text
    base = summarize(load_run_dir(out / "baseline"))
    assert base.first_overflow > 30 and base.first_grad_nonfinite >= base.first_overflow
    # the measured tables of docs/scenario.md are written from this run, not by hand
    doc = tmp_path / "scenario.md"
    doc.write_text("# head\n\n<!-- measured:begin -->\nold\n<!-- measured:end -->\n\ntail\n")
    w = run_cli([sys.executable, str(ROOT / "scripts" / "scenario_doc.py"), str(out),
                 "--doc", str(doc)], cwd=ROOT)  # fmt: skip
    assert w.returncode == 0, w.stderr
    written = doc.read_text()
    assert "old" not in written and written.endswith("tail\n") and "commit" in written
    assert "| reference (3 seeds) |" in written and "### Conclusions" in written


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
    from stabilize.report.conclusions import conclusions
    from stabilize.report.summary import ArmSummary

    base = ArmSummary("baseline", "b", "done", precision="fp16-mixed", early_skip_share=1.0)
    base.min_loss_scale, base.steps = 0.0, 400
    eps = ArmSummary("large_eps", "e", "done", precision="fp16-mixed", early_skip_share=0.0)
    eps.first_overflow, eps.dead_tokens, eps.final_loss = 8, 10.0, 5.55
    fp32 = ArmSummary("fp32_reduction", "f", "done", precision="fp16-mixed", rel_err=3.5e-4)
    text = "\n".join(conclusions([base, eps, fp32]))
    assert "baseline never trained: the GradScaler skipped 100%" in text
    # "fixes it" is a verdict against a reference (stabilize/report/verdict.py), never said
    # from the absence of a NaN alone
    assert "fixes it" not in text


def test_a_rollback_that_overflowed_again_is_not_called_recovered():
    from stabilize.report.conclusions import conclusions
    from stabilize.report.summary import ArmSummary

    r = ArmSummary("remedy", "r", "done", precision="fp16-mixed", rollbacks=2, final_loss=2.6)
    r.remedies, r.steps = ["lower_lr", "fp32_reduction"], 120
    assert "remedy recovered through 2 rollback(s)" in "\n".join(conclusions([r]))
    r.overflow_after_rollback = True
    text = "\n".join(conclusions([r]))
    assert "recovered" not in text.replace("did not recover", "")
    assert "it overflowed again after the last remedy" in text
