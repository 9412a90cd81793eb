"""The one-run report reads true against its own events: the README's one-run command, run
for real (shrunk), then ``stabilize-report`` on it.

On that command (fp16 post-norm RMSNorm with an fp16 reduction) no norm overflows in the
forward and the loss stays finite, but every step is a GradScaler skip (inf/NaN gradients)
until the loss-scale monitor calls for a rollback. Those skips are non-finite gradients that
forced a rollback, not the scale's calibration, so the table's backward cell must name the
first of them, never "never". Each cell is checked against events.jsonl, read here by hand.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from doc_commands import doc_command

from stabilize.report import main as report_main
from stabilize.train import run
from tests.conftest import FAST, compose_run

# the README's one-run command as the docs show it, shrunk: 6 steps, a rollback after 3
# consecutive skips instead of 10 (the same chain, sooner)
README_RUN = [a for a in shlex.split(doc_command("one-run"))[1:] if "max_steps" not in a]
SHRUNK = [*FAST, "trainer.max_steps=6", "monitor.loss_scale.max_consecutive_skips=3"]


def cells(line: str) -> list[str]:
    """A markdown table row's cells, the report's escapes undone."""
    return [re.sub(r"\\(.)", r"\1", c).strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("one_run")
    run(compose_run(d, [*README_RUN, *SHRUNK]))
    assert report_main([str(d)]) == 0
    rows = [cells(x) for x in (d / "report" / "report.md").read_text().splitlines()
            if x.startswith("| ")]  # fmt: skip
    events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    return dict(zip(rows[0], rows[1], strict=True)), events


def test_the_first_non_finite_cell_names_the_skips_that_forced_a_rollback(one_run):
    row, events = one_run
    skips = [e["step"] for e in events if e["monitor"] == "loss_scale" and e["kind"] == "skip"]
    verdicts = [e["step"] for e in events if e["monitor"] == "loss_scale"
                and e["kind"] == "rollback"]  # fmt: skip
    assert verdicts, "the shrunk README run no longer rolls back on its skips"
    # by hand: from the first verdict, back over the steps that were all skips
    first = verdicts[0]
    while first - 1 in skips:
        first -= 1
    loss = [e for e in events if e["monitor"] == "nonfinite"]
    assert not loss and not [e for e in events if e["monitor"] == "overflow"]
    cell = row["first non-finite: loss (forward) / grads (backward)"]
    assert cell == f"never / {first} (scaler skip)", cell


def test_every_other_cell_of_the_row_is_what_the_events_say(one_run):
    row, events = one_run

    def of(monitor, kind=None):
        return [e for e in events if e["monitor"] == monitor and kind in (None, e["kind"])]

    assert row["first |x|>256"] == str(of("activation")[0]["step"]) if of("activation") \
        else row["first |x|>256"] == "never"  # fmt: skip
    assert row["first overflow"] == "never" and not of("overflow")
    assert row["scaler skips"].split()[0] == str(len(of("loss_scale", "skip")))
    rollbacks = of("rollback", "rollback")
    remedies = ", ".join(e["extra"]["remedy"] for e in rollbacks)
    assert row["rollbacks (remedies)"] == f"{len(rollbacks)} ({remedies})"
