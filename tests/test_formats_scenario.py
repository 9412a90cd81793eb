"""The formats scenario (configs/experiment/formats.yaml, docs/formats.md): its documented
command, shrunk, writes a verdict table whose "what it hides" columns are the runs' own
metrics.csv extremes, and whose verdicts say only what the gaps beside them allow."""

from __future__ import annotations

import math
import shlex

import pytest
from doc_commands import doc_command

from stabilize.report.quant_hides import Extreme, QuantHides, quant_words
from stabilize.report.verdict import Verdict

from conftest import ROOT, read_csv_metrics, run_cli

SHORT = ["trainer.max_steps=16", "fault.step=4", "trainer.val_check_interval=8",
         "trainer.checkpoint_every_n_steps=8", "trainer.final_eval_batches=4"]  # fmt: skip
ARMS = ("fp8_delayed16", "mxfp8_floor")


def hides(sat: float = 0.0) -> QuantHides:
    return QuantHides(
        saturated=Extreme(sat, "h.0.attn.c_proj.x", 40),
        clipped=Extreme(0.0, "h.0.attn.c_proj.x", 1),
        sqnr_db=Extreme(24.5, "h.1.mlp.c_fc.dy", 7),
        underflow=Extreme(0.0, "h.0.attn.c_proj.dy", 1),
        saturated_steps=3 if sat else 0,
    )


def verdict(inside: bool | None, sigma: float) -> Verdict:
    return Verdict("fp8_delayed16", True, 0.01 * sigma, 0.02, inside, "", sigma_bpb=sigma)


@pytest.mark.parametrize(
    ("inside", "sigma", "label"),
    [(True, 0.4, "no NaN, no measurable gap"),
     (False, 5.0, "no NaN, trains worse"),
     (None, 0.4, "no NaN (no spread to judge)")],
)  # fmt: skip
def test_a_quantized_arms_words_follow_its_gap_and_never_say_fixed(inside, sigma, label):
    got, words = quant_words("fp8_delayed16", verdict(inside, sigma), hides(0.0052), (3.0, 3.2))
    assert got == label and 'fixed":' in words and "fixes" not in words
    assert f"{0.01 * sigma:+.3f} bpb held out" in words
    assert "saturated up to 0.52% of h.0.attn.c_proj.x (step 40" in words
    assert ("above the reference's band" in words) == (inside is False)
    _, calm = quant_words("fp8_current", verdict(True, 0.1), hides(0.0), (3.0, 3.2))
    assert "no operand saturated" in calm and "lowest SQNR 24.5 dB (h.1.mlp.c_fc.dy" in calm


def _rows(report: str) -> dict[str, list[str]]:
    table = report[report.index("## Against the reference") :].split("\n\n")[1]
    lines = [line.strip("|").split(" | ") for line in table.splitlines()]
    head = [c.strip() for c in lines[0]]
    return {c[0].strip(): dict(zip(head, (x.strip() for x in c), strict=True)) for c in lines[2:]}


def _extreme(rows, prefix: str, pick) -> tuple[float, str, int]:
    # the report's steps are the model's (Lightning's csv "step" + 1: the fault's own count)
    found = [(r[k], k.removeprefix(prefix), int(r["step"]) + 1) for r in rows for k in r
             if k.startswith(prefix) and math.isfinite(r[k])]  # fmt: skip
    best = pick(v for v, _, _ in found)
    return min((f for f in found if f[0] == best), key=lambda f: (f[2], f[1]))


def test_the_documented_command_shrunk_reports_what_each_format_hid(tmp_path):
    cmd = shlex.split(doc_command("formats-scenario"))
    cmd[cmd.index("--arms") + 1] = ",".join(("reference", *ARMS))
    out = tmp_path / "formats"
    r = run_cli(["bash", str(ROOT / cmd[0]), *cmd[1:], "--reference-seeds", "2", "--out",
                 str(out), "--", *SHORT], cwd=tmp_path, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows((out / "report.md").read_text())
    assert rows["reference (2 seeds)"]["max saturated share"] == "-"
    for arm in ARMS:
        row, metrics = rows[arm], read_csv_metrics(out / arm)
        for column, prefix, pick, fmt in (
            ("max saturated share", "q_sat/", max, "{:.2%}"),
            ("max clipped-block share", "q_clip/", max, "{:.2%}"),
            ("min SQNR (dB)", "q_sqnr/", min, "{:.1f}"),
            ("max underflow share", "q_under/", max, "{:.2%}"),
        ):
            v, where, step = _extreme(metrics, prefix, pick)
            want = "0" if v == 0 and "%" in fmt else f"{fmt.format(v)} ({where}, step {step})"
            assert row[column] == want, (arm, column)
            if column == "min SQNR (dB)":  # said in words too, with the same number
                assert f"its lowest SQNR {v:.1f} dB ({where}, step {step})" in row["what it hides"]
        assert "held-out gap" not in row["what it hides"]  # the gap columns say that
        # the verdict's words and the gap beside them
        assert "fix" not in row["verdict"]
        inside = row["inside band"] == "yes"
        assert row["verdict"] == ("no NaN, no measurable gap" if inside else "no NaN, trains worse")
    # the growth reached fp8_delayed16's c_proj input: its amax grew with f (rate 1.25)
    amax = {int(r["step"]): r["q_amax/h.0.attn.c_proj.x"] for r in read_csv_metrics(
        out / "fp8_delayed16") if "q_amax/h.0.attn.c_proj.x" in r}  # fmt: skip
    assert amax[15] > 5 * amax[2]
