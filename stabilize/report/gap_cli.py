"""``stabilize-gap RUN --reference REF [REF ...]``: how far a run is from its reference, in
units of seed noise (``report/gap.py``; docs/design-precision.md).

    stabilize-gap runs/bf16 --reference runs/fp32-s0 runs/fp32-s1 runs/fp32-s2

Prints the held-out and last-steps gaps with their sigma and verdict, where the per-step
gap opens, and what ``stabilize-replay --gap`` / ``--tail`` found for the run where they
ran (``RUN/gap/bisection.json``, ``tail.json``); writes ``gap.json`` and ``gap.png`` (the
smoothed per-step gap with the reference's band) to ``--out`` (default ``RUN/gap``). Exit
0: a real gap; 1: inside the noise (or it cannot be told); 2: bad input, one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stabilize.exits import EXIT_CONFIG


def plot(j, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = j.steps
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.fill_between(s.steps, [-h for h in s.half], s.half, color="0.85",
                    label="reference band (95%, one more seed)")  # fmt: skip
    ax.plot(s.steps, s.gap, color="C3", label=f"gap to the reference mean (over {s.window})")
    ax.axhline(0, color="0.4", lw=0.8)
    if s.opens_at is not None:
        ax.axvline(s.opens_at, color="C3", ls=":", label=f"opens at step {s.opens_at}")
    ax.set_xlabel("model step")
    ax.set_ylabel("training loss gap (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
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
    if j.steps.steps:
        print(f"plot: {plot(j, out, f'{args.run.name} vs {len(refs)} reference seeds')}")
    return 0 if g.real else 1


if __name__ == "__main__":
    sys.exit(main())
