"""``stabilize-report``: compare runs (a scenario's arms) in a table, plots and conclusions.

    stabilize-report RUN_DIR [RUN_DIR ...] [--out DIR] [--title T] [--cost cost.json]
    stabilize-report --wandb ENTITY/PROJECT --group G [--out DIR]

Writes DIR/report.md (default: the common parent of the run dirs) with one table row per
run, the chain of events, each forecast warning beside its real lead, PNG plots beside it
(x: the model's step), and for a scenario's arms the verdicts and conclusions its numbers
support (with ``--cost``, the step cost scripts/arm_cost.py measured paired), for a sweep a
table keyed by the swept values, for one run its conclusion: what went wrong, which remedy
fixed it, its repro bundles.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from stabilize.report.chain import chain
from stabilize.report.conclusions import conclusions
from stabilize.report.cost import cost_cells, cost_note, load_cost
from stabilize.report.forecasts import forecast_rows
from stabilize.report.load import Run, load_run_dir, load_wandb
from stabilize.report.markdown import code as md_code
from stabilize.report.markdown import table as md_table
from stabilize.report.markdown import text as md_text
from stabilize.report.naming import arm_names, is_scenario, swept
from stabilize.report.plots import make_plots
from stabilize.report.quant_hides import NOTE as QUANT_NOTE
from stabilize.report.quant_hides import judge_quant, quant_rows
from stabilize.report.quant_layers import PLOT_NOTE as QUANT_PLOT_NOTE
from stabilize.report.quant_layers import layer_lines
from stabilize.report.single import run_conclusion
from stabilize.report.summary import (
    COMPARE,
    LAST_STEPS,
    ArmSummary,
    compare_row,
    summarize,
    table,
)
from stabilize.report.verdict import facts, judge, verdict_rows


def _comparison(runs: list[Run], arms: list[ArmSummary]) -> list[str]:
    """A sweep's table: one row per member, keyed by its swept values."""
    values = swept(runs)
    keys = list(values[0]) if values else []
    rows = [[*keys, *COMPARE]]
    rows += [[*(v[k] for k in keys), *compare_row(a)] for v, a in zip(values, arms, strict=True)]
    lines = ["## Comparison", "", md_table(rows), ""]
    lines += best_lines(arms)
    return lines


def best_lines(arms: list[ArmSummary]) -> list[str]:
    """Which finished arm did best: by bits per byte on the whole held-out split when every
    finished arm has it, else by the mean training loss of the last steps."""
    done = [a for a in arms if a.status == "done" and a.final_loss is not None]
    if len(done) < 2:
        return []
    if all(a.heldout_bpb is not None for a in done):
        best = min(done, key=lambda a: a.heldout_bpb)
        # "whole" only when every arm scored every held-out block (trainer.final_eval_batches)
        whole = "the whole" if all(a.heldout_whole for a in done) else "part of the"
        return [
            f"Lowest bits per byte on {whole} held-out split ({best.heldout_bytes:,} bytes): "
            f"{md_code(best.arm)} ({best.heldout_bpb:.4g}).",
            "",
        ]
    best = min(done, key=lambda a: a.final_loss)
    return [
        f"Lowest training loss over the last {LAST_STEPS} steps: {md_code(best.arm)} "
        f"({best.final_loss:.3g}).",
        "",
    ]


VERDICT_NOTE = (
    "*NaN stopped*: no non-finite loss or gradient norm, and no more GradScaler skips "
    "(inf/NaN gradients) from the arm's first overflowed reduction on than any reference seed "
    "had over the same steps (after its last rollback, for an arm that rolled back). *NaN-"
    "gradient skips*: the arm's skips in that window, all taken as NaN gradients when there are "
    "more of them than any reference seed had over the same steps, none otherwise (a skip is "
    "also the loss scale's calibration: the reference's row gives each seed's skips over the "
    "whole run). *gap*: the arm's value minus the reference's mean "
    "over its seeds, and in brackets in units of seed noise, s * sqrt(1 + 1/n) (3 or more "
    "seeds; `stabilize-gap`, report/gap.py); *band*: the 95% prediction interval for one more "
    "reference seed, mean +- "
    "t(0.975, n-1) * s * sqrt(1 + 1/n) over the n seeds; *inside band*: the arm's held-out bpb "
    "and last-steps loss are at or below the band's upper end (`-`: 1 reference seed, no "
    "spread). *dies*: the loss flat at ln V (a uniform guess over the V tokens) to the end, "
    "after it had been lower, and held out too. *what it hides*: measured by the norm audit "
    "(`audit.jsonl`), and for a bf16 arm its held-out gap in seed noise."
)


def write_report(
    runs: list[Run], out: Path, title: str = "stabilize report", cost: dict | None = None
) -> Path:
    """report.md, summary.json and the plots in ``out``; ``cost``: a paired cost measurement
    (``report/cost.py``'s ``load_cost``), the verdict table's cost column."""
    out.mkdir(parents=True, exist_ok=True)
    for r, name in zip(runs, arm_names(runs), strict=True):
        r.arm = name  # the name says what differs: the arm, or the swept key=value pairs
    arms = [summarize(r) for r in runs]
    scenario = is_scenario(runs)
    plots = make_plots(runs, out)
    lines = [f"# {title}", ""]
    lines += [
        "Runs: " + ", ".join(f"{md_code(r.arm)} ({md_text(r.source)})" for r in runs),
        "",
    ]
    if not scenario and len(runs) > 1:
        lines += _comparison(runs, arms)
    lines += [
        "## Per arm" if scenario else "## Per run",
        "",
        md_table(table(arms)),
        "",
        "Steps are the model's own steps (a rollback rewinds them), in the table and on every "
        "plot's x axis. *first |x|>256*: the first "
        "activation warning; *first overflow*: the first norm whose fp16 sum of squares "
        "overflowed (its rows come out as zeros with a zero gradient: dead tokens); *first "
        "non-finite*: the first step whose loss was NaN/inf (the forward) / the first whose "
        "gradients were (the backward): a GradScaler skip (inf/NaN gradients) at or after the "
        "first overflow or in a run of skips that the loss-scale monitor answered with a "
        "rollback verdict (any other skip is the loss scale's calibration), or a non-finite "
        "gradient norm without a scaler; *256 warning lead*: steps from that warning to the first "
        "non-finite value, loss or gradients; *loss before*: "
        f"the last logged loss before the line was crossed; *final loss*: the mean training "
        f"loss of the last {LAST_STEPS} model steps; *held-out bpb*: bits per byte on the "
        "held-out split after training, whole unless `trainer.final_eval_batches` cut it "
        "(`final_eval.json`; `-` where the run did not "
        "finish or the score was off); *norm rel. err*: median relative "
        "error of every norm's output against float64 on held-out batches, on steps the fault "
        "had not reached (the precision's own cost); *flattened rows*: share of norm rows more "
        "than 5% off sqrt(D) with gamma at 1 (the cost of a large eps).",
        "",
    ]
    if any(not a.exact for a in arms):
        lines += ["`~`: rebuilt from logged metrics (W&B API): as fine as the log interval.", ""]
    if len(runs) == 1:  # no reference to judge by: the run's own story
        said = run_conclusion(runs[0], arms[0])
        lines += ["## Conclusion", "", *(f"- {c}" for c in said), ""]
    if scenario and len(runs) > 1:  # one run has no reference: its conclusion is above
        fs = [facts(r, a) for r, a in zip(runs, arms, strict=True)]
        ref, verdicts = judge(arms, fs)
        hidden = judge_quant(runs, ref, verdicts)  # quantized arms: what their formats hid
        cells = None
        if cost is not None:
            cells = cost_cells(cost, {a.arm: (f.arm, a) for a, f in zip(arms, fs, strict=True)})
        rows = quant_rows(verdict_rows(ref, verdicts, cells), verdicts, hidden)
        lines += ["## Against the reference", "", md_table(rows), ""]
        lines += [VERDICT_NOTE + " " + cost_note(cost), ""]
        lines += [QUANT_NOTE, ""] if hidden else []
        lines += ["## Conclusions", ""]
        found = conclusions(arms)  # the baseline's chain first, then the verdicts, then costs
        chain_first = [c for c in found if c.startswith("Baseline chain")]
        said = (
            chain_first + [v.words for v in verdicts] + [c for c in found if c not in chain_first]
        )
        # plain sentences with the arms' names in them: written as text, not markdown
        lines += [f"- {md_text(c)}" for c in said] or ["- (no run had anything to conclude from)"]
        lines += [""]
    lines += layer_lines(runs)  # quantized arms: which operands hit the format's max
    told = [(a.arm, a.rollback_story) for a in arms if a.rollback_story]
    if told:
        lines += ["## Rollbacks", ""]
        lines += [
            "Each rollback: the verdicts that called for it, the rung of the ladder it took, "
            "what that rung changed, and whether a later rollback undid it.",
            "",
        ]
        for arm, story in told:
            lines += [f"### {md_text(arm)}", "", *story, ""]
    unreadable = [w for r in runs for w in r.warnings]
    if unreadable:  # what was skipped, by file and line: the rest is reported above and below
        lines += ["## Warnings", "", *(f"- {md_code(w)}" for w in unreadable), ""]
    warned = forecast_rows(runs)
    if len(warned) > 1:
        lines += ["## Forecast warnings", ""]
        lines += [
            "Each overflow forecast beside what came of it. *estimated lead*: the steps left "
            "the warning gave (as natural growth slows; in brackets, at that step's rate); "
            "*real lead*: optimizer steps from the warning to the layer's crossing of that line "
            "(its fp16 reduction overflowed: the row-RMS line; its |x| max passed 256: the "
            "|x| line), `never` if it did not cross.",
            "",
            md_table(warned),
            "",
        ]
    lines += ["## Plots", ""]
    lines += [
        "x: the model step. Solid: the trajectory the run kept; faded, ending in `x`: an "
        "attempt a rollback dropped (replayed after it); dotted: a rollback, at the step the "
        "model rewound to; dashed: the first overflowed fp16 reduction; shaded: steps with "
        "non-finite values; a diamond: where a line ends (its legend entry says what follows). "
        "An arm that lies on another is drawn thinner, on top (its entry: at which steps). "
        "In act_max, dotted: the overflowing norm's largest row RMS, against the row RMS "
        "past which its fp16 sum of squares overflows."
        + (" " + QUANT_PLOT_NOTE if "quant_headroom" in plots else ""),
        "",
    ]
    for name, p in plots.items():
        lines += [f"![{name}]({p.name})", ""]
    lines += ["## Chain of events per arm" if scenario else "## Chain of events per run", ""]
    for r in runs:
        lines += [f"### {md_text(r.arm)}", ""]
        lines += [f"1. {c}" for c in chain(r)] or ["No events: nothing was flagged."]
        if r.diagnosis:
            lines += ["", f"Diagnosis: {r.diagnosis.get('reason')}"]
        lines += [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps([asdict(a) for a in arms], indent=2, default=str))
    return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stabilize-report",
        description="Compare stabilize runs: a table per arm, conclusions and PNG plots.",
    )
    p.add_argument("runs", nargs="*", help="run directories (as stabilize-train writes them)")
    p.add_argument("--out", help="where report.md and the plots go (default: the runs' parent)")
    p.add_argument("--title", default="stabilize report")
    p.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read the runs from the W&B API")
    p.add_argument("--group", help="with --wandb: the W&B group (a scenario's name)")
    p.add_argument("--cost", metavar="cost.json", help="each arm's step cost measured paired "
                   "(scripts/arm_cost.py): the verdict table's cost column")  # fmt: skip
    a = p.parse_args(argv)
    if a.wandb and not a.group:
        p.error("--wandb needs --group G (the group whose runs to compare)")
    if not a.wandb and not a.runs:
        p.error("give run directories, or --wandb ENTITY/PROJECT --group G")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    try:
        runs = load_wandb(a.wandb, a.group) if a.wandb else [load_run_dir(d) for d in a.runs]
        cost = load_cost(a.cost)
        if a.cost and cost is None:
            raise FileNotFoundError(f"--cost {a.cost!r} does not exist")
    except (FileNotFoundError, ValueError) as e:
        print(f"stabilize-report: {e}", file=sys.stderr)
        return 2
    if a.out:
        out = Path(a.out)
    elif a.runs:
        out = Path(os.path.commonpath([str(Path(d).resolve()) for d in a.runs]))
        if len(a.runs) == 1:
            out = out / "report"
    else:
        out = Path("reports") / a.group
    for r in runs:
        for w in r.warnings:
            print(f"stabilize-report: warning: {w}", file=sys.stderr)
    report = write_report(runs, out, a.title, cost)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
