"""``stabilize-replay BUNDLE``: replay a failing step from its repro bundle, in this process.

    stabilize-replay runs/x/bundles/step-000004-nonfinite            # does it reproduce?
    stabilize-replay --bisect runs/x/bundles/step-000004-overflow    # the norms to switch
    stabilize-replay --data runs/x/bundles/step-000006-nonfinite     # the sequences to skip
    stabilize-replay --trust-code runs/mylm/bundles/step-000006-nonfinite  # your model's
    stabilize-replay --gap runs/bf16 --reference runs/fp32-s0 runs/fp32-s1 runs/fp32-s2
    stabilize-replay --spike runs/x --reference runs/ref-s0 runs/ref-s1 runs/ref-s2

``core.py`` checks the bundle and replays the step (optionally with norms switched to fp32,
or with a subset of its sequences); ``bisect.py`` halves over either. Exit 0: it reproduces
(a bisection: found); 1: it does not (nothing found; ``--data`` on a fault the run classed
deterministic or transient: found but not recorded, without ``--record``; ``--gap`` and
``--tail``: a gap inside the seed noise); 2: a bad bundle, one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stabilize.exits import EXIT_CONFIG
from stabilize.replay.core import BadBundle, replay, report
from stabilize.replay.rebuild import CodeChoice


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stabilize-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path, help="a run's bundles/step-NNNNNN-<monitor> directory")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--bisect", action="store_true", help="find the fewest norms whose fp32 "
                     "reduction clears the step; print them as a Hydra override")  # fmt: skip
    how.add_argument("--data", action="store_true", help="find the fewest sequences of the "
                     "step that still fail it; record them (by block index and content hash) "
                     "for the run's resume and print them as a Hydra override; a loader "
                     "we do not own: by its batch, row and content hash; a fault the run "
                     "classed deterministic or transient: named, not recorded")  # fmt: skip
    how.add_argument("--gap", action="store_true", help="BUNDLE is a run dir: judge its gap "
                     "to --reference and find the fewest precision sites whose switch to fp32 "
                     "closes it over a window of replayed steps")  # fmt: skip
    how.add_argument("--tail", type=int, default=None, metavar="STEP", help="BUNDLE is a run "
                     "dir: judge its gap to --reference as --gap does; a real one: fork it at "
                     "STEP (a checkpoint of it, 0: its start), train the rest at --reference's "
                     "precision, say the share of the gap recovered")  # fmt: skip
    how.add_argument("--spike", action="store_true", help="BUNDLE is a run dir: replay the "
                     "steps after its spike as it happened and with each remedy (skip, clip, "
                     "lower_lr); the damage left and the steps to recover")  # fmt: skip
    p.add_argument("--trust-code", action="store_true", help="a bundle of a model we did not "
                   "build (a LightningModule's, a Guard's): import the module, factory and "
                   "loss its meta.json names, from this environment; without it (or "
                   "--factory) the replay names them and runs nothing")  # fmt: skip
    p.add_argument("--factory", metavar="PKG.MOD:FN", help="your own function that builds "
                   "the model, in place of the one the bundle names (a LightningModule's: "
                   "called with the saved hyperparameters; a Guard's: with none)")  # fmt: skip
    p.add_argument("--loss", metavar="PKG.MOD:FN", help="a Guard's bundle: your own "
                   "loss_fn(model, batch), in place of the one the bundle names")  # fmt: skip
    p.add_argument("--record", action="store_true", help="--data: record the sequences in the "
                   "run's skipped_items.json even where the run classed the fault as not "
                   "data-linked (deterministic, transient)")  # fmt: skip
    p.add_argument("--reference", type=Path, nargs="+", help="--gap, --tail, --spike: the "
                   "reference's run dirs (--spike: optional, for seed noise)")  # fmt: skip
    p.add_argument("--at", type=int, default=None, help="--spike: the spike's model step "
                   "(default: the run's first spike event, or its planted grad_spike)")  # fmt: skip
    p.add_argument("--steps", type=int, default=50, help="--spike: steps replayed after the "
                   "spike (default 50, or to the end)")  # fmt: skip
    p.add_argument("--window", type=int, default=None, help="--gap: steps replayed (default "
                   "50, or to the end)")  # fmt: skip
    p.add_argument("--share", type=float, default=0.8, help="--gap: the share of the window's "
                   "gap the sites must close (default 0.8)")  # fmt: skip
    args = p.parse_args(argv)
    from stabilize.replay.bisect import data_main, precision_main
    from stabilize.trust import UntrustedFile

    code = _code(args)
    if args.record and not args.data:  # it edits the run's future: never on a guess of intent
        code = "--record goes with --data (it records the sequences a data bisection finds)"
    if isinstance(code, str):
        print(f"stabilize-replay: {code}", file=sys.stderr)
        return EXIT_CONFIG
    if args.gap or args.tail is not None:
        return _gap(p, args)
    if args.spike:
        return _spike(args)
    try:
        if args.data:
            return data_main(args.bundle, code, force=args.record)
        if args.bisect:
            return precision_main(args.bundle, code)
        out = replay(args.bundle, code=code)
    except (BadBundle, UntrustedFile) as e:
        print(f"stabilize-replay: {e}", file=sys.stderr)
        return EXIT_CONFIG
    lines = report(args.bundle, out)
    print("\n".join(lines))
    return 0 if lines[-1].endswith("yes") else 1


def _code(args) -> CodeChoice | str:
    """What the user allows a foreign model's replay to import, or why the flags are
    refused (one line)."""
    from stabilize.replay.rebuild import CannotRebuild, check_target

    given = [f for f, v in (("--trust-code", args.trust_code), ("--factory", args.factory),
                            ("--loss", args.loss)) if v]  # fmt: skip
    if given and (args.gap or args.tail is not None or args.spike):
        return (f"{given[0]} goes with a bundle's replay (BUNDLE, --bisect, --data), not with "
                "--gap, --tail or --spike (run dirs of our GPT)")  # fmt: skip
    try:
        for flag, v in (("--factory", args.factory), ("--loss", args.loss)):
            if v is not None:
                check_target(v, flag)
    except CannotRebuild as e:
        return str(e)
    return CodeChoice(trust_code=args.trust_code, factory=args.factory, loss=args.loss)


def _gap(p: argparse.ArgumentParser, args) -> int:
    from stabilize.replay.gap_bisect import gap_main, tail_main

    bad, flag = None, "--gap" if args.gap else "--tail"
    if not args.reference:
        bad = f"{flag} needs --reference REF [REF ...] (the reference's run dirs)"
    elif args.tail is not None and args.tail < 0:
        bad = f"--tail={args.tail} is not allowed; must be a model step >= 0"
    elif args.window is not None and args.window < 1:
        bad = f"--window={args.window} is not allowed; must be a positive integer"
    elif not 0 < args.share <= 1:
        bad = f"--share={args.share} is not allowed; must be in (0, 1]"
    else:
        for d in [args.bundle, *args.reference]:
            if not (d / "config.json").is_file():
                bad = f"{d}: not a run dir (no config.json)"
                break
    if bad:
        print(f"stabilize-replay: {bad}", file=sys.stderr)
        return EXIT_CONFIG
    if args.tail is None:
        return gap_main(args.bundle, args.reference, args.window, args.share)
    try:
        return tail_main(args.bundle, args.reference, args.tail)
    except ValueError as e:
        print(f"stabilize-replay: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _spike(args) -> int:
    from stabilize.replay.spike import spike_main

    bad = None
    if args.steps < 1:
        bad = f"--steps={args.steps} is not allowed; must be a positive integer"
    elif args.at is not None and args.at < 1:
        bad = f"--at={args.at} is not allowed; must be a model step >= 1"
    else:
        for d in [args.bundle, *(args.reference or [])]:
            if not (d / "config.json").is_file():
                bad = f"{d}: not a run dir (no config.json)"
                break
    if bad is None:
        try:
            return spike_main(args.bundle, list(args.reference or []), args.at, args.steps)
        except ValueError as e:
            bad = str(e)
    print(f"stabilize-replay: {bad}", file=sys.stderr)
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
