"""Every sentence of the report is what the run did (issue 34, items 2-4).

The runs here are run dirs written the way stabilize-train writes them (config.json, the CSV
log, events.jsonl, audit.jsonl, final_eval.json, result.json), with the numbers the main job
measured (tests/test_scenario.py trains the real arms): three healthy reference seeds and
their GradScaler calibration skips, a baseline whose fp16 reduction overflows at step 41 and
whose loss then sits at ln 256, an arm that trains worse, an arm that is fine. Every
expectation is derived from those numbers (or from the report's own table cells) by
arithmetic in the test, never copied from the report.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from stabilize.report import load_run_dir, write_report
from stabilize.report import main as report_main
from stabilize.report.plots import PALETTE, figures

from conftest import ROOT

V, STEPS, OVERFLOW, FLAT = 256, 120, 41, 43
REF_SKIPS = {1234: [19, 24, 25], 1235: [2, 35, 51], 1236: [19, 20, 22, 93]}  # the main job's
REF_SCORES = {1234: (3.227, 2.54), 1235: (3.200, 2.55), 1236: (3.271, 2.55)}  # bpb, loss
BASE_SKIPS = [19, 24, 25, 54, 56, 59]
HELD_TOKENS = HELD_BYTES = 23296  # the byte tokenizer: one token per byte


def healthy(step: int, end: float, seed: int) -> float:
    """A learning curve from ln V down to ``end``, with a little per-seed wobble."""
    k = 1 - math.exp(-step / 25)
    return math.log(V) * (1 - k) + end * k + 0.01 * math.sin(step * seed)


def write_run(d, arm, seed, losses, events=(), final=None, audits=(), rollback=False):
    """A run dir as stabilize-train writes it (the parts the report reads)."""
    (d / "csv" / "version_0").mkdir(parents=True)
    cfg = {"arm": arm, "seed": seed, "name": "nan_repro", "precision": {"name": "fp16-mixed"},
           "model": {"vocab_size": V, "block_size": 64}, "data": {"batch_size": 8},
           "norm": {"reduction_dtype": "fp16", "eps": 1e-5},
           "rollback": {"enabled": rollback}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    lines = ["step,train/step,train/loss_step,train/loss_scale_step"]
    lines += [f"{s - 1},{s},{v!r},8192.0" for s, v in losses]
    (d / "csv" / "version_0" / "metrics.csv").write_text("\n".join(lines) + "\n")
    evs = [{"global_step": e.get("global_step", e["step"]), **e} for e in events]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    (d / "audit.jsonl").write_text("".join(json.dumps(a) + "\n" for a in audits))
    if final is not None:
        bpb, loss = final
        score = {"loss": loss, "bpb": bpb, "whole": True, "tokens": HELD_TOKENS,
                 "bytes": HELD_BYTES}  # fmt: skip
        (d / "final_eval.json").write_text(json.dumps(score))
    (d / "result.json").write_text(json.dumps({"status": "done", "model_step": STEPS}))
    return d


def skip(step):
    return {"kind": "skip", "monitor": "loss_scale", "step": step, "value": 8192.0,
            "message": f"GradScaler skips step {step} (inf/NaN gradients)"}  # fmt: skip


def overflow(step, layer="ln_f", rows=512.0, kind="warn"):
    return {"kind": kind, "monitor": "overflow", "step": step, "layer": layer, "value": rows,
            "message": f"{layer}: {rows:g} rows' reduction overflowed",
            "extra": {"collapsed": rows, "nan_rows": 0.0}}  # fmt: skip


def crossed(step, layer):
    return {"kind": "warn", "monitor": "activation", "step": step, "layer": layer,
            "value": 257.8, "message": f"{layer}: |x| max 257.8 crossed 256"}  # fmt: skip


def forecast(step, layer, line, left, rate):
    return {"kind": "warn", "monitor": "forecast", "step": step, "layer": layer, "value": left,
            "message": f"{layer}: crosses in ~{left:.0f} steps",
            "extra": {"line": line, "at_this_rate": rate}}  # fmt: skip


def dying_events():
    """The baseline's events as the main job recorded them: the forecast, the overflow at
    41 spreading to every norm, the 256 crossing at 47, the scaler's skips."""
    ev = [skip(s) for s in BASE_SKIPS if s < OVERFLOW]
    ev += [forecast(33, "ln_f", "rms", 21.1, 17.9), forecast(36, "h.1", "abs", 13.1, 11.2)]
    ev += [overflow(OVERFLOW, rows=130.0)]
    for s in range(OVERFLOW + 1, 61):
        ev += [overflow(s, "h.1.ln_1"), overflow(s)]
        ev += [crossed(s, "h.1")] if s == 47 else []
        ev += [skip(s)] if s in BASE_SKIPS else []
    return ev


def dying_losses():
    out = []
    for s in range(1, STEPS + 1):
        v = healthy(s, 2.5, 1234) if s < OVERFLOW else 3.73 if s == OVERFLOW else 5.48
        out.append((s, math.log(V) + 1e-6 if s >= FLAT else v))
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("truth")
    runs = {}
    for seed, (bpb, loss) in REF_SCORES.items():
        losses = [(s, healthy(s, loss, seed)) for s in range(1, STEPS + 1)]
        runs[f"ref{seed}"] = write_run(root / f"ref{seed}", "reference", seed, losses,
                                       [skip(s) for s in REF_SKIPS[seed]],
                                       (bpb, loss * 0.88))  # fmt: skip
    runs["baseline"] = write_run(root / "baseline", "baseline", 1234, dying_losses(),
                                 dying_events(), (8.0, math.log(V)),
                                 audits=[{"step": 120, "rel_err_median": 4e-4,
                                          "flattened_share": 0.0, "dead_share": 0.9}])  # fmt: skip
    # overflowed at 41 and trains worse, with one skip after it (the reference had one there)
    worse = [(s, healthy(s, 3.5, 1234)) for s in range(1, STEPS + 1)]
    worse_events = [skip(19), overflow(OVERFLOW, rows=3.0), skip(60)]
    runs["lower_lr"] = write_run(
        root / "lower_lr", "lower_lr", 1234, worse, worse_events, (4.0, 3.1)
    )
    fine = [(s, healthy(s, 2.55, 1234)) for s in range(1, STEPS + 1)]
    runs["fp32_reduction"] = write_run(root / "fp32_reduction", "fp32_reduction", 1234, fine,
                                       [crossed(45, "h.1")], (3.22, 2.24))  # fmt: skip
    loaded = [load_run_dir(d) for d in runs.values()]
    report = write_report(loaded, root / "report", "truth")
    return runs, report.read_text()


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    nxt = text.find("\n## ", start + 3)
    return text[start : nxt if nxt >= 0 else len(text)]


def cells(line: str) -> list[str]:
    """A markdown table row's cells, the report's escapes undone."""
    return [re.sub(r"\\(.)", r"\1", c).strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def table(text: str, title: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header, {first cell: cells}) of the first table in a section."""
    rows = [cells(x) for x in section(text, title).splitlines() if x.startswith("| ")]
    return rows[0], {r[0]: r for r in rows[1:]}


def conclusion(text: str, arm: str) -> str:
    body = section(text, "Conclusions")
    return next(x for x in body.splitlines() if x.startswith(f"- {arm} "))


def steps_in(sentence: str) -> list[int]:
    """The step each clause ("; "-separated) is about: the first it names."""
    firsts = (re.search(r"\bsteps? (\d+)", c) for c in sentence.split("; "))
    return [int(m.group(1)) for m in firsts if m]


# ---- item 2: a dead model is called dead ----------------------------------------------------
def test_a_model_flat_at_ln_v_dies_and_its_sentence_carries_the_tables_numbers(scenario):
    _, text = scenario
    head, per_arm = table(text, "Per arm")
    vhead, verdicts = table(text, "Against the reference")
    col = {h: i for i, h in enumerate(head)}
    final_col = next(h for h in head if h.startswith("final loss"))
    judged = [a for a in verdicts if not a.startswith("reference")]
    assert judged
    for arm in judged:
        row = per_arm[arm]
        final, bpb = float(row[col[final_col]]), float(row[col["held-out bpb"]])
        # a uniform guess over V tokens: ln V nats, log2 V bits per byte (1 token per byte)
        uniform = abs(final - math.log(V)) <= 0.01 * math.log(V)
        uniform &= abs(bpb - math.log2(V)) <= 0.01 * math.log2(V)
        label = verdicts[arm][-1]
        assert label.startswith("dies") == uniform, (arm, final, bpb, label)
        if not uniform:
            continue
        said = conclusion(text, arm)
        assert said.startswith(f"- {arm} dies: ")
        assert f"overflowed at step {row[col['first overflow']]}" in said
        assert f"{row[col['dead rows (sum)']]} dead rows" in said
        assert f"{math.log(V):.3f} = ln {V}" in said
        assert f"{bpb:.2f} bpb held out = log2 {V}" in said
        assert "predicts uniformly" in said and "does not stop the NaN" not in said
        assert steps_in(said) == sorted(steps_in(said)), said  # told in step order
    assert any(verdicts[a][-1].startswith("dies") for a in judged)  # the baseline is one


def test_a_scaler_skip_counts_as_nan_only_beyond_the_references_own_skips(scenario):
    _, text = scenario
    head, verdicts = table(text, "Against the reference")
    # lower_lr: one skip after its overflow, as the reference had one over those steps: it
    # stopped the NaN, and it trains worse (its bpb is far outside the band)
    assert verdicts["lower_lr"][-1] == "stops the NaN, trains worse"
    col = {h: i for i, h in enumerate(head)}
    beyond = next(h for h in head if h.startswith("NaN-gradient skips"))
    arm_skips = {"baseline": BASE_SKIPS, "lower_lr": [19, 60]}
    for arm, skips in arm_skips.items():
        window = [s for s in skips if OVERFLOW <= s <= STEPS]
        # the reference's own rate over the same steps: the most any seed had there, by hand
        allowance = max(sum(OVERFLOW <= s <= STEPS for s in ss) for ss in REF_SKIPS.values())
        nan = len(window) > allowance
        cell = verdicts[arm][col[beyond]]
        assert cell.startswith(f"{len(window) if nan else 0} ("), cell
        assert f"the reference at most {allowance} there" in cell
        assert (verdicts[arm][col["NaN stopped"]] == "no") == nan
        if nan:
            said = conclusion(text, arm)
            assert "NaN gradients at steps " in said and "skipped by the loss scaler" in said
            assert all(str(s) in said for s in window)


def test_the_first_non_finite_columns_say_forward_and_backward(scenario):
    _, text = scenario
    head, per_arm = table(text, "Per arm")
    both = head.index("first non-finite: loss (forward) / grads (backward)")
    first_skip = min(s for s in BASE_SKIPS if s >= OVERFLOW)  # by hand: 54
    # no NaN loss (the scaler skipped the NaN gradients), the gradients' first NaN
    assert per_arm["baseline"][both] == f"never / {first_skip} (scaler skip)"
    assert per_arm["fp32_reduction"][both] == "never / never"
    chain = next(x for x in section(text, "Conclusions").splitlines() if "Baseline chain" in x)
    # the seed's chain (overflow, zeros, NaN gradients) and what the loss scaler did with it
    assert "zeros" in chain and f"step {first_skip}: the gradients went non-finite" in chain
    assert "What the loss scaler did with it" in chain and "no NaN reached the weights" in chain


# ---- item 3: a cost only as measured paired -------------------------------------------------
def test_no_cost_column_without_a_paired_measurement(scenario):
    _, text = scenario
    head, _ = table(text, "Against the reference")
    assert not any("step time" in h or "cost" in h for h in head), head
    note = section(text, "Against the reference")
    assert "side by side" not in note and "scripts/arm_cost.py" in note


def test_the_cost_column_is_each_arms_round_ratios_median_and_range(scenario, tmp_path):
    """scripts/arm_cost.py for real (two arms, three rounds), then the report's cell held
    against the per-round ratios computed here from the file it wrote."""
    runs, _ = scenario
    out = tmp_path / "cost.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "arm_cost.py"), "--out", str(out), "--arms",
         "reference,bf16,remedy", "--rounds", "3", "--warmup", "1", "--threads", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    cost = json.loads(out.read_text())
    assert cost["clock"] == "cpu" and cost["threads"] == 1 and cost["untimed"] == ["remedy"]
    assert set(cost["step_s"]) == {"reference", "bf16"}
    assert all(len(v) == 3 and min(v) > 0 for v in cost["step_s"].values())
    # the bf16 run of the report is named fp32_reduction here: cost the arm it is
    cost["step_s"]["fp32_reduction"] = cost["step_s"].pop("bf16")
    ratios = [a / b for a, b in zip(cost["step_s"]["fp32_reduction"], cost["step_s"]["reference"],
                                    strict=True)]  # fmt: skip
    expected = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    text = write_report([load_run_dir(d) for d in runs.values()], tmp_path / "r", "t", cost)
    head, verdicts = table(text.read_text(), "Against the reference")
    col = next(i for i, h in enumerate(head) if h.startswith("step time / reference (paired"))
    assert verdicts["fp32_reduction"][col] == expected
    assert verdicts["baseline"][col] == "not timed"  # not in the measurement: no number


def test_an_untimed_arm_that_rolled_back_shows_the_steps_it_took():
    """The remedy arm is not timed (its step changes with its rung): its cell gives the
    optimizer steps it took for its model steps, both numbers whole."""
    from stabilize.report.cost import cost_cells
    from stabilize.report.summary import ArmSummary

    remedy = ArmSummary(arm="remedy", name="remedy", status="done", steps=120, steps_taken=123)
    cells = cost_cells({"step_s": {"reference": [1.0, 2.0]}}, {"remedy": ("remedy", remedy)})
    assert cells == {
        "reference": "1.00 (1.00-1.00)",
        "remedy": "not timed; 123 optimizer steps taken for 120 (its rollbacks undid the rest)",
    }


# ---- item 4: the small untruths -------------------------------------------------------------
def test_the_band_footnote_says_what_is_computed(scenario):
    _, text = scenario
    _, verdicts = table(text, "Against the reference")
    bpb = [b for b, _ in REF_SCORES.values()]
    n, m, sd = len(bpb), statistics.fmean(bpb), statistics.stdev(bpb)
    half = 4.302653 * sd * math.sqrt(1 + 1 / n)  # t(0.975, 2), by hand: a 95% prediction interval
    ref = next(v for k, v in verdicts.items() if k.startswith("reference"))
    assert f"band {m - half:.3f}-{m + half:.3f}" in " ".join(ref)
    note = section(text, "Against the reference")
    assert "worst reference seed" not in note  # the band is wider than the seeds' range
    assert m + half > max(bpb) and "95% prediction interval" in note


def test_the_baseline_chain_is_told_in_step_order(scenario):
    _, text = scenario
    chain = next(x for x in section(text, "Conclusions").splitlines() if "Baseline chain" in x)
    told = steps_in(chain)
    assert OVERFLOW in told and 47 in told  # the overflow (41) and the 256 crossing (47)
    assert told == sorted(told), chain


def test_each_forecast_warning_shows_its_real_lead_beside_its_estimate(scenario):
    _, text = scenario
    head, _ = table(text, "Forecast warnings")
    rows = [cells(x) for x in section(text, "Forecast warnings").splitlines()
            if x.startswith("| ")][1:]  # fmt: skip
    col = {h: i for i, h in enumerate(head)}
    by = {(r[col["layer"]], int(r[col["warned at step"]])): r for r in rows}
    # by hand from the events written: ln_f warned at 33 of its sum of squares, which
    # overflowed at 41; h.1 warned at 36 of 256, crossed at 47
    for layer, at, crossing, estimate in (("ln_f", 33, OVERFLOW, 21.1), ("h.1", 36, 47, 13.1)):
        r = by[(layer, at)]
        assert r[col["real lead"]] == str(crossing - at)
        assert r[col["estimated lead"]].startswith(f"~{estimate:.0f}")


def test_audit_png_draws_a_run_audited_once(scenario):
    runs, _ = scenario
    run = load_run_dir(runs["baseline"])
    assert len(run.audits) == 1
    fig = figures([run])["audit"]
    for ax in fig.axes:  # the legend's swatch is in the colour too: count the data alone
        ax.get_legend().remove()
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    plt.close(fig)
    color = np.array(to_rgb(PALETTE[0]))  # the first (only) run's colour
    drawn = (np.abs(img - color).sum(axis=-1) < 0.1).sum()
    assert drawn > 20, drawn  # its point is drawn, in both panels


def test_one_run_gets_a_conclusion_that_names_the_rung_that_did_not_help(tmp_path):
    """A remedy run whose first rung (lower_lr) did not stop the overflow and whose second
    (fp32_reduction) did, with the bundles it wrote."""
    d = tmp_path / "remedy"

    def rolled(remedy, taken, **did):
        return {"kind": "rollback", "monitor": "rollback", "step": 41, "global_step": taken,
                "message": f"rolled back from step 41 to 40 (overflow); remedy {remedy}",
                "extra": {"restored_step": 40, "remedy": remedy, **did}}  # fmt: skip

    ev = [skip(19), forecast(33, "ln_f", "rms", 21.1, 17.9),
          overflow(41, rows=130.0, kind="rollback"), rolled("lower_lr", 41, lr_factor=0.5),
          {**overflow(41, rows=120.0, kind="rollback"), "global_step": 43},
          rolled("fp32_reduction", 43, norms_switched=5)]  # fmt: skip
    losses = [(s, healthy(s, 2.55, 1234)) for s in range(1, STEPS + 1)]
    write_run(d, "remedy", 1234, losses, ev, (3.22, 2.24), rollback=True)
    bundles = []
    for step in (41, 43):
        b = d / "bundles" / f"step-{step:06d}-overflow"
        b.mkdir(parents=True)
        (b / "meta.json").write_text(json.dumps({"step": 41, "events": [overflow(41)]}))
        bundles.append(b)
    assert report_main([str(d)]) == 0  # one run dir: the report beside it
    text = (d / "report" / "report.md").read_text()
    said = section(text, "Conclusion")
    assert "What went wrong: step 41: the first fp16 reduction overflowed (ln_f)" in said
    assert "lower_lr" in said and re.search(r"lower_lr[^\n]* did not help", said)
    assert re.search(r"fp32_reduction[^\n]* fixed it", said)
    assert not re.search(r"lower_lr[^\n]* fixed it", said)
    for b in bundles:
        assert f"`stabilize-replay --bisect {b}`" in said


def test_one_run_without_an_overflow_says_what_the_monitors_flagged(tmp_path):
    """The README's one-run command (fp16 post-norm): the scaler skips from step 1, the
    loss-scale monitor rolls back at step 11; lower_lr does not help, fp32_reduction does."""
    d = tmp_path / "one"
    verdict = {
        "kind": "rollback",
        "monitor": "loss_scale",
        "step": 11,
        "message": "11 consecutive scaler skips (max 10); first non-finite gradient: x",
    }

    def rolled(remedy, taken):
        return {
            "kind": "rollback",
            "monitor": "rollback",
            "step": 11,
            "global_step": taken,
            "message": f"rolled back; remedy {remedy}",
            "extra": {"restored_step": 10, "remedy": remedy},
        }

    ev = [skip(s) for s in range(1, 12)] + [verdict, rolled("lower_lr", 11)]
    ev += [{**skip(11), "global_step": 12}, {**verdict, "global_step": 12}]
    ev += [rolled("fp32_reduction", 12)]  # fmt: skip
    write_run(d, None, 1234, [(s, healthy(s, 3.0, 1)) for s in range(1, 26)], ev, rollback=True)
    assert report_main([str(d)]) == 0
    said = section((d / "report" / "report.md").read_text(), "Conclusion")
    skips = [e for e in ev if e["monitor"] == "loss_scale" and e["kind"] == "skip"]
    assert f"step 1: the GradScaler skipped a step (inf/NaN gradients), {len(skips)} times" in said
    assert "step 11: loss_scale: 11 consecutive scaler skips (max 10)" in said
    assert re.search(r"lower_lr[^\n]* did not help", said)
    assert re.search(r"fp32_reduction[^\n]* fixed it", said)
