"""One run's conclusion: what went wrong, which remedy fixed it, where to replay it.

``stabilize-report RUN_DIR`` on a single run has no reference to judge by, so its conclusion
is the run's own story: the chain of what went wrong in step order (``conclusions.py``'s
links: the overflow and its zeros, a collapse to a uniform guess, non-finite gradients or
loss), then each rollback's rung and whether it helped. A rung helped when its fault did
not come back: a later rollback answering the same monitor means it did not (e.g.
``lower_lr`` before ``fp32_reduction`` on an overflow that lower LR cannot stop). The last
rung fixed it when no overflow, non-finite value or rollback verdict came after it and the
run finished. Last, the run's repro
bundles (``bundles/step-NNNNNN-<monitor>``) and the commands that replay and bisect them.
"""

from __future__ import annotations

import json
from pathlib import Path

from stabilize.report.conclusions import chain_links
from stabilize.report.forecasts import taken
from stabilize.report.load import Run
from stabilize.report.markdown import code, text
from stabilize.report.rollbacks import rollbacks
from stabilize.report.summary import LAST_STEPS, ArmSummary

# events after the last rollback that say the fault is still there
FAULTS = ("overflow", "nonfinite")


def _bundles(run: Run) -> list[tuple[Path, str, str]]:
    """(bundle dir, "step N, monitor", the replay's code flag) of every bundle the run kept,
    by step."""
    if run.path is None or not (run.path / "bundles").is_dir():
        return []
    out = []
    for d in sorted((run.path / "bundles").iterdir()):
        if not d.is_dir() or not d.name.startswith("step-"):
            continue
        what, flag = d.name.removeprefix("step-"), ""
        try:
            meta = json.loads((d / "meta.json").read_text())
            monitors = sorted({e.get("monitor") for e in meta.get("events", [])} - {None})
            what = f"step {meta.get('step')}, {', '.join(monitors) or '?'}"
            # a model we did not build: its replay imports the user's code, by their choice
            if (meta.get("host") or {}).get("kind") in ("lightning", "guard"):
                flag = "--trust-code "
        except (OSError, ValueError, AttributeError):
            pass
        out.append((d, what, flag))
    return out


def run_conclusion(run: Run, a: ArmSummary) -> list[str]:
    """The conclusion's sentences for one run, as markdown (prose literal, commands as code)."""
    return [text(x) if isinstance(x, str) else "".join(x) for x in _sentences(run, a)]


def _sentences(run: Run, a: ArmSummary) -> list[str | tuple[str, ...]]:
    """Plain sentences, or a sentence's markdown pieces (a command as a code span)."""
    out: list[str | tuple[str, ...]] = []
    chain = [(s, link, t) for s, link, t in chain_links(a) if s is not None and link != "line"]
    # skips alone (no overflow, no NaN loss) are told below, with their count and the verdict
    told = a.grad_nonfinite_by == "scaler skip" and all(x[1] == "grads" for x in chain)
    links = [] if told else [(s, t) for s, _, t in chain]
    if not links:  # no overflow, no non-finite loss: what the monitors flagged instead
        verdict = next((e for e in run.events if e.get("kind") == "rollback"
                        and e.get("monitor") != "rollback"), None)  # fmt: skip
        if verdict is not None:
            msg = str(verdict.get("message", "")).split("; ")[0]
            links.append((int(verdict["step"]), f"{verdict.get('monitor')}: {msg}"))
        skips = sorted(int(e["step"]) for e in run.events if e.get("monitor") == "loss_scale"
                       and e.get("kind") == "skip")  # fmt: skip
        if skips and verdict is not None:
            first = a.first_grad_nonfinite if told else skips[0]  # the table's cell
            links.insert(0, (first, f"the GradScaler skipped a step (inf/NaN gradients), "
                             f"{len(skips)} times in all"))  # fmt: skip
    if links:
        out.append("What went wrong: " + "; ".join(f"step {s}: {t}" for s, t in links) + ".")
    elif a.status == "done" and not a.rollbacks:
        out.append("Nothing went wrong: no overflow, no non-finite loss or gradients, no "
                   "rollback.")  # fmt: skip
    rbs = rollbacks(run.events)
    rb_events = [e for e in run.events if e.get("monitor") == "rollback"
                 and e.get("kind") == "rollback"]  # fmt: skip
    for n, rb in enumerate(rbs, 1):
        monitor = (rb.cause or {}).get("monitor", "?")
        what = f"Rollback {n} (step {rb.step}, {rb.remedy}: {rb.effect})"
        again = next((m for m, later in enumerate(rbs[n:], n + 1)
                      if (later.cause or {}).get("monitor") == monitor), None)  # fmt: skip
        if again is not None:
            out.append(f"{what} did not help: the same fault ({monitor}) came back at step "
                       f"{rbs[again - 1].step} (rollback {again}).")  # fmt: skip
        elif n < len(rbs):
            out.append(f"{what} answered {monitor}; a different fault followed.")
        else:
            last = taken(rb_events[-1]) if rb_events else 0
            still = [e for e in run.events if taken(e) > last and (
                e.get("monitor") in FAULTS or (e.get("kind") == "rollback"
                                               and e.get("monitor") != "rollback"))]  # fmt: skip
            if not still and a.status == "done":
                out.append(f"{what} fixed it: no overflow, non-finite value or rollback verdict "
                           f"came after it, and the run reached step {a.steps} (mean loss of its "
                           f"last {LAST_STEPS} steps {a.final_loss:.3g}).")  # fmt: skip
            else:
                seen = sorted({str(e.get("monitor")) for e in still})
                out.append(f"{what} did not fix it: after it came {', '.join(seen) or 'no'} "
                           f"events and the run ended {a.status}.")  # fmt: skip
    if links and not rbs:
        on = (run.config.get("rollback") or {}).get("enabled")
        if on is False:
            out.append((text("No remedy was tried: rollback was off ("), code("rollback=default"),
                        text(" turns the ladder on).")))  # fmt: skip
        else:
            out.append("No remedy was tried.")
    bundles = _bundles(run)
    for d, what, flag in bundles:
        out.append((
            text(f"Repro bundle {d} ({what}): "), code(f"stabilize-replay {flag}{d}"),
            text(" replays that step; "), code(f"stabilize-replay --bisect {flag}{d}"),
            text(" finds the fewest norms whose fp32 reduction clears it."),
        ))  # fmt: skip
    if links and not bundles:
        out.append((text("No repro bundle was kept ("), code("rollback.bundle=fault"),
                    text(" writes one per fault).")))  # fmt: skip
    return out
