"""The live diagnosis names the module the replay names (issue 34, item 1).

On the README's one-run command (fp16 post-norm RMSNorm with an fp16 reduction) the first
steps are scaler skips: the fp16 rsqrt backward of a norm overflows. The step's gradients
alone cannot say where: the first non-finite one in backward order is the weight the head
shares with the embedding, which sums the embedding's gradient, come up through the norm.
The live console re-runs that step with hooks; ``stabilize-replay`` replays its bundle in a
fresh model. The independent reference: putting the named norm's reduction in fp32 clears
the replayed step (and the head is no norm to switch). A real Lightning run, in-process.
"""

from __future__ import annotations

import re
import shlex

import pytest
from doc_commands import doc_command

from stabilize.replay.core import fails, replay, report
from stabilize.run.summary import final_summary, read_events
from stabilize.stability.grad_scan import describe, origin
from stabilize.train import run
from tests.conftest import FAST, compose_run

# the README's one-run command as the docs show it (tests/doc_commands.py), its overrides
# shrunk to 2 steps (FAST after it)
README_RUN = [a for a in shlex.split(doc_command("one-run"))[1:] if "max_steps" not in a]
SHRUNK = [*FAST, "trainer.max_steps=2", "logger=none", "rollback.bundle=always"]
LIVE = re.compile(r"SKIP step (\d+): .*first non-finite gradient: (\S+) \(")
REPLAYED = re.compile(r"backward: first non-finite gradient in (\S+) ")


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme_run")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = run(compose_run(d, [*README_RUN, *SHRUNK]))
    return d, out, buf.getvalue()


def test_the_console_names_the_module_the_replay_names_and_neither_is_the_head(readme_run):
    d, _, console = readme_run
    m = LIVE.search(console)
    assert m, console
    step, live = int(m.group(1)), m.group(2)
    bundle = d / "bundles" / f"step-{step:06d}-loss_scale"
    out = replay(bundle)
    lines = report(bundle, out)
    assert "reproduces: yes" in lines, lines
    replayed = REPLAYED.search("\n".join(lines))
    assert replayed, lines
    assert live == replayed.group(1)
    assert live != "lm_head" and live.startswith("h.") and "ln" in live
    # the reference: that norm in fp32 clears the step; the head is no norm at all
    assert fails(out) and not fails(replay(bundle, fp32_sites=frozenset({live})))
    assert "the step re-run with hooks" in console and "it made the non-finite value" in console


def test_the_events_and_the_summary_keep_the_scan_and_the_rerun_apart(readme_run):
    d, out, _ = readme_run
    evs = read_events(d)
    scanned = [e["extra"]["grad_scan"] for e in evs if (e.get("extra") or {}).get("grad_scan")]
    first = scanned[0]
    # the step's gradients alone: the tied weight, named with its other owner, no origin
    assert first["scan_module"] == "lm_head" and first["found_by"] == "rerun"
    assert first["grad_module"] != "lm_head" and first["grad_incoming_finite"] is True
    summary = "\n".join(final_summary(compose_run(d, [*README_RUN, *SHRUNK]), out, evs))
    assert f"first non-finite gradient, at step 1: {first['grad_module']} (it made" in summary
    assert "lm_head" not in summary


def test_a_tied_weight_found_by_the_scan_alone_claims_no_origin():
    """Words against what the scan can know (hand-built results, the scan's own keys)."""
    tied = {"grad_module": "lm_head", "grad_incoming_finite": None, "loss_finite": True,
            "found_by": "scan", "shared_with": ["wte"], "rerun": "finite"}  # fmt: skip
    words = describe(tied)
    assert "shares with wte" in words and "made at lm_head or anywhere below it" in words
    assert "it made the non-finite value" not in words and "re-run of the step was finite" in words
    nan_loss = {**tied, "loss_finite": False}
    assert origin(nan_loss).startswith("none made it: the loss was non-finite")


def test_a_poisoned_sequence_is_named_at_the_embedding_live_and_in_the_replay(tmp_path):
    """``fault=poisoned_item`` makes its row of the embedding output NaN (a hook on ``wte``).
    The replay named ``drop`` in the forward (its trace's hook ran before the fault's) and
    the pass-through ``logit_softcap`` in the backward; both now name the embedding, and
    the backward says it was non-finite from the loss on."""
    from test_data_bisect import COMMON, POSITION, _planted

    item = _planted(tmp_path)[0]
    d = tmp_path / "run"
    fault = ["fault=poisoned_item", f"fault.item={item}", f"trainer.max_steps={POSITION + 1}"]
    run(compose_run(d, [*COMMON, *fault]))
    (v,) = [e for e in read_events(d) if e["kind"] == "rollback" and e["monitor"] == "nonfinite"]
    (live,) = v["extra"]["localization"]
    assert (live["module"], live["from_loss"], live["from_forward"]) == ("wte", True, "wte")
    (bundle,) = (d / "bundles").iterdir()
    out = replay(bundle)
    assert out["forward"]["module"] == "wte" and out["backward"]["from_forward"] == "wte"
    lines = "\n".join(report(bundle, out))
    assert "forward: first non-finite output in wte" in lines
    assert (
        "backward: non-finite from the loss on: made by the forward's non-finite output "
        "(first in wte)" in lines
    )
    assert "drop" not in lines and "logit_softcap" not in lines
