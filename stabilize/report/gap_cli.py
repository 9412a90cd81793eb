"""``stabilize-gap RUN --reference REF [REF ...]``: how far a run is from its reference, in
units of seed noise (``report/gap.py``; docs/design-precision.md).

    stabilize-gap runs/bf16 --reference runs/fp32-s0 runs/fp32-s1 runs/fp32-s2

Prints the held-out and last-steps gaps with their sigma and verdict, where the per-step
gap opens, and what ``stabilize-replay --gap`` / ``--tail`` found for the run where they
ran (``RUN/gap/bisection.json``, ``tail.json``); writes ``gap.json`` and ``gap.png`` (the
judged scores' gaps beside the reference's band, the smoothed per-step gap with its band,
and the judgement's lines) to ``--out`` (default ``RUN/gap``). Exit
0: a real gap; 1: inside the noise (or it cannot be told); 2: bad input, one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stabilize.exits import EXIT_CONFIG


def figure(j, title: str):
    """What the judgement says, drawn (a matplotlib Figure). Left: the scores the verdict is
    on (held-out, last steps), each as the run's gap to the reference mean beside the
    reference seeds' own spread and the 95% band for one more seed. Right: the per-step
    training-loss gap, smoothed, with its band: another measure (a training step's loss is
    far noisier than a whole held-out split), which the words judge separately ("opens at"
    / "never stays above"). Under both, the judgement's own lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = [g for g in (j.heldout, j.last) if g is not None]
    lines = j.lines()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4 + 0.18 * len(lines)),
                                      gridspec_kw={"width_ratios": [1, 2.4]})  # fmt: skip
    ys = [0.0]
    for x, g in enumerate(gaps):
        mean = g.run - g.value
        if g.half is not None:
            left.plot([x, x], [-g.half, g.half], color="0.8", lw=10, solid_capstyle="butt",
                      gid="band", label="95% band, one more seed" if x == 0 else None)  # fmt: skip
        seeds = [r - mean for r in g.ref]
        left.plot([x] * g.n, seeds, "o", color="0.35", ms=4, gid="seeds",
                  label="reference seeds" if x == 0 else None)  # fmt: skip
        left.plot([x], [g.value], "D", color="C3", gid="run",
                  label="this run" if x == 0 else None)  # fmt: skip
        ys += [*seeds, g.value, *([-g.half, g.half] if g.half is not None else [])]
    lo, hi = min(ys), max(ys)
    left.set_ylim(lo - 0.08 * (hi - lo or 1), hi + 0.5 * (hi - lo or 1))  # room for the legend
    left.axhline(0, color="0.4", lw=0.8)
    left.set_xticks(range(len(gaps)), [g.score for g in gaps], fontsize=8)
    left.set_xlim(-0.6, len(gaps) - 0.4)
    left.set_ylabel("gap to the reference mean (nats)")
    left.set_title("the judged scores", fontsize=10)
    left.legend(fontsize=7, loc="upper left")
    s = j.steps
    if s.steps:
        right.fill_between(s.steps, [-h for h in s.half], s.half, color="0.85", gid="band",
                           label="95% band, one more seed")  # fmt: skip
        right.plot(s.steps, s.gap, color="C3", gid="gap", label="gap to the reference mean")
        if s.opens_at is not None:
            right.axvline(s.opens_at, color="C3", ls=":", label=f"opens at step {s.opens_at}")
        right.legend(fontsize=7)
    right.axhline(0, color="0.4", lw=0.8)
    right.set_xlabel("model step")
    right.set_ylabel("training-loss gap (nats)")
    right.set_title(f"per step: training loss, each curve smoothed over {s.window} steps"
                    if s.steps else "per step: no step every run logged", fontsize=10)  # fmt: skip
    fig.suptitle(title, fontsize=10)
    for i, line in enumerate(lines):  # the words, verbatim, under the panels they judge
        fig.text(0.01, 0.02 + 0.045 * (len(lines) - 1 - i), line, fontsize=7.5, gid="judgement")
    fig.tight_layout(rect=(0, 0.05 * len(lines) + 0.01, 1, 1))
    return fig


def plot(j, out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(j, title)
    path = out / "gap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def found_before(run: Path, refs: list[Path]) -> dict:
    """What ``stabilize-replay --gap`` / ``--tail`` found for this run against these same
    reference dirs, where they ran: ``RUN/gap/bisection.json`` and ``RUN/gap/tail.json``
    (one made against other references, or unreadable, is left out)."""
    names = sorted(str(Path(r).resolve()) for r in refs)
    out = {}
    for key in ("bisection", "tail"):
        try:
            found = json.loads((run / "gap" / f"{key}.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("references") == names:
            out[key] = found
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stabilize-gap", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="the run dir to judge")
    p.add_argument("--reference", type=Path, nargs="+", required=True,
                   help="the reference's run dirs, one per seed (>= 3 for the noise)")  # fmt: skip
    p.add_argument("--window", type=int, default=None,
                   help="steps the per-step curve is smoothed over (default: a tenth)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="default RUN/gap")
    args = p.parse_args(argv)
    from stabilize.report.gap import bisection_words, judge, tail_words
    from stabilize.report.load import load_run_dir
    from stabilize.report.rundirs import check_run_dirs

    if args.window is not None and args.window < 1:
        print(f"stabilize-gap: --window={args.window} is not allowed; must be a positive "
              "integer", file=sys.stderr)  # fmt: skip
        return EXIT_CONFIG
    try:
        # each dir a finished run, ours or a loop of the user's, scored held out where its
        # config asked for it: a foreign or unfinished reference has no score to pair with
        # the run's, and the verdict would fall on the run
        check_run_dirs(args.run, args.reference, scored=False, own_loop=True)
        run = load_run_dir(args.run)
        refs = [load_run_dir(r) for r in args.reference]
    except (FileNotFoundError, ValueError) as e:
        print(f"stabilize-gap: {e}", file=sys.stderr)
        return EXIT_CONFIG
    j = judge(run, refs, args.window)
    if j.primary is None:
        print(f"stabilize-gap: {args.run}: no training loss or held-out score to compare",
              file=sys.stderr)  # fmt: skip
        return EXIT_CONFIG
    print(f"gap of {args.run} to {len(refs)} reference seed(s):")
    for line in j.lines():
        print(f"  {line}")
    found = found_before(args.run, args.reference)
    for key, words in (("bisection", bisection_words), ("tail", tail_words)):
        try:
            print(f"  {words(found[key])} (stabilize-replay, {key}.json)")
        except (KeyError, TypeError, ValueError):  # absent, or a file of another version
            found.pop(key, None)
    out = args.out or args.run / "gap"
    out.mkdir(parents=True, exist_ok=True)
    g = j.primary
    (out / "gap.json").write_text(json.dumps({
        "run": str(args.run), "reference": [str(r) for r in args.reference],
        "score": g.score, "gap": g.value, "sigma": g.sigma, "band": g.half, "real": g.real,
        "heldout": None if j.heldout is None else j.heldout.value,
        "last_steps": None if j.last is None else j.last.value,
        "opens_at": j.steps.opens_at, "window": j.steps.window, **found,
    }, indent=1))  # fmt: skip
    print(f"plot: {plot(j, out, f'{args.run.name} vs {len(refs)} reference seeds')}")
    return 0 if g.real else 1


if __name__ == "__main__":
    sys.exit(main())
