"""The scenario's conclusions: sentences the per-arm table's numbers support.

Rules over ``ArmSummary`` figures (``report/summary.py``), so a different outcome gives a
different text. The baseline's chain is told in step order, each link at the step it was
recorded, then what a loss scaler did with it: the seed's story (an overflow, zeros out of
the norm, NaN gradients) ends in NaN; under a GradScaler the NaN gradients are skipped steps,
and a model whose rows are zeros goes on, silently dead.
"""

from __future__ import annotations

from stabilize.report.summary import LINE, ArmSummary, _pct


def _nan_part(a: ArmSummary) -> str:
    """The NaN-producing rows beside the dead ones, when there were any."""
    return (
        f", {a.nan_rows:g} rows turned NaN (input past the reduction dtype)" if a.nan_rows else ""
    )


def _recovered(a: ArmSummary) -> bool:
    """Recovered: finished, never non-finite, and no overflow event after the last rollback
    (not "no NaN" alone: an overflow that did not turn NaN is still the fault)."""
    return a.status == "done" and a.first_nonfinite is None and not a.overflow_after_rollback


def chain_links(a: ArmSummary) -> list[tuple[int | None, str, str]]:
    """(step, link, what happened) of the arm's chain, in step order; a link that never
    happened (step None) last. Links: ``line`` (a warning only), ``overflow``, ``dead``,
    ``grads``, ``loss``."""
    where = f" ({a.first_overflow_where})" if a.first_overflow_where else ""
    links: list[tuple[int | None, str, str]] = [
        (a.first_over_line, "line", f"|x| max first passed {LINE:g}"),
        (
            a.first_overflow,
            "overflow",
            f"the first fp16 reduction overflowed{where} and its rows came out of the norm "
            f"as zeros ({a.dead_tokens:g} token rows zeroed{_nan_part(a)} over all norms and "
            f"steps)",
        ),
    ]
    if a.dead:
        links.append(
            (
                a.flat_from,
                "dead",
                f"the training loss went flat at {a.uniform_loss:.3f} = ln {a.vocab} (a uniform "
                f"guess over {a.vocab} tokens)",
            )
        )
    if a.first_grad_nonfinite is not None:
        how = (
            "a GradScaler skip: inf/NaN gradients"
            if a.grad_nonfinite_by == "scaler skip"
            else "a non-finite gradient norm"
        )
        links.append((a.first_grad_nonfinite, "grads", f"the gradients went non-finite ({how})"))
    if a.first_loss_nonfinite is not None:
        where = f" in {a.nonfinite_where}" if a.nonfinite_where else ""
        links.append((a.first_loss_nonfinite, "loss", f"the loss went non-finite{where}"))
    done = sorted((x for x in links if x[0] is not None), key=lambda x: x[0])
    return done + [x for x in links if x[0] is None]


def baseline_chain(a: ArmSummary) -> str:
    said = [
        f"step {s}: {t}" if s is not None else t.replace("first passed", "never passed")
        for s, _, t in chain_links(a)
    ]
    if a.first_nonfinite_any is None:
        said.append("no non-finite value followed")
    out = "Baseline chain (in step order): " + "; ".join(said) + "."
    if a.grad_nonfinite_by == "scaler skip" and a.first_loss_nonfinite is None:
        scale = f", its scale down to {a.min_loss_scale:g}" if a.min_loss_scale else ""
        out += (
            " What the loss scaler did with it: it skipped every step whose gradients were "
            f"inf/NaN ({a.skips_after_overflow} skips from the overflow on{scale}), so no NaN "
            "reached the weights "
            "or the loss"
            + (
                f", and the run went on dead: loss {a.final_loss:.3f} over its last steps"
                + (f", {a.heldout_bpb:.2f} bpb held out" if a.heldout_bpb is not None else "")
                if a.dead
                else ""
            )
            + "."
        )
    return out


def conclusions(arms: list[ArmSummary]) -> list[str]:
    """Sentences the table's numbers support, one per finding."""
    out: list[str] = []
    by = {a.arm: a for a in arms}
    base = by.get("baseline")
    if base is not None and base.first_overflow is not None:
        out.append(baseline_chain(base))
    if base is not None and base.warning_lead is not None:
        forecast = ""
        if base.first_forecast is not None and base.first_over_line is not None:
            forecast = (
                f"; the overflow forecast came {base.first_over_line - base.first_forecast} "
                f"steps earlier still"
            )
        before = ""
        if base.first_overflow is not None and base.first_overflow < base.first_over_line:
            before = (
                f" (it came {base.first_over_line - base.first_overflow} steps after the first "
                f"overflow: a row's fp16 sum of squares overflows before any one |x| reaches "
                f"{LINE:g})"
            )
        out.append(
            f"The |x| > {LINE:g} warning preceded the first non-finite value by "
            f"{base.warning_lead} steps in the baseline{before}{forecast}."
        )
    for a in arms:
        if a.never_trained:
            out.append(
                f"{a.arm} never trained: the GradScaler skipped "
                f"{100 * a.early_skip_share:.0f}% of its steps before any overflow or drift "
                f"(lowest loss scale {a.min_loss_scale:.3g}): its fp16 reduction overflows in "
                f"the backward, for tokens of small norm (the embeddings at init)."
            )
    for a in arms:
        if a.rollbacks:
            out.append(rollback_sentence(a))
    errs = {a.arm: a.rel_err for a in arms if a.rel_err}
    if len(errs) > 1:
        worst = max(errs, key=errs.get)
        best = min(errs, key=errs.get)
        out.append(
            f"Precision cost on healthy steps: {worst}'s norm outputs are off by "
            f"{errs[worst]:.2g} (median relative error vs float64), "
            f"{errs[worst] / errs[best]:.0f}x {best}'s {errs[best]:.2g}."
        )
    flat = {a.arm: a.flattened for a in arms if a.flattened is not None}
    if flat and max(flat.values()) > 0:
        worst = max(flat, key=flat.get)
        out.append(
            f"Large-eps cost: {_pct(flat[worst])} of token rows in {worst} come out of the "
            f"norm more than 5% off sqrt(D) (eps is not negligible against their mean square)."
        )
    return out


def rollback_sentence(a: ArmSummary) -> str:
    ladder = " -> ".join(a.remedies) if a.remedies else "?"
    if a.aborted:
        return f"{a.arm}: {a.rollbacks} rollbacks ({ladder}), then gave up (abort)."
    why = f", called by {', '.join(a.triggers)}" if a.triggers else ""
    ended = f"reached step {a.steps} with loss {a.final_loss:.3g}"
    if _recovered(a):
        return (
            f"{a.arm} recovered through {a.rollbacks} rollback(s){why} ({ladder}) "
            f"and {ended}; no overflow after the last remedy."
        )
    return (
        f"{a.arm} rolled back {a.rollbacks} time(s){why} ({ladder}) and {ended}, but did not "
        "recover: "
        + (
            "it overflowed again after the last remedy."
            if a.overflow_after_rollback
            else "it went non-finite or did not finish."
        )
    )
