"""``stabilize-replay BUNDLE``: replay a failing step from its repro bundle, in this process.

    stabilize-replay runs/x/bundles/step-000004-nonfinite            # does it reproduce?
    stabilize-replay --bisect runs/x/bundles/step-000004-overflow    # the norms to switch
    stabilize-replay --data runs/x/bundles/step-000006-nonfinite     # the sequences to skip

``core.py`` checks the bundle and replays the step (optionally with norms switched to fp32,
or with a subset of its sequences); ``bisect.py`` halves over either. Exit 0: it reproduces
(a bisection: found); 1: it does not (nothing found); 2: a bad bundle, one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stabilize.exits import EXIT_CONFIG
from stabilize.replay.core import BadBundle, replay, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stabilize-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path, help="a run's bundles/step-NNNNNN-<monitor> directory")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--bisect", action="store_true", help="find the fewest norms whose fp32 "
                     "reduction clears the step; print them as a Hydra override")  # fmt: skip
    how.add_argument("--data", action="store_true", help="find the fewest sequences of the "
                     "step that still fail it; record them (by block index and content hash) "
                     "for the run's resume and print them as a Hydra override; a loader "
                     "we do not own: by its batch, row and content hash")  # fmt: skip
    args = p.parse_args(argv)
    from stabilize.replay.bisect import data_main, precision_main
    from stabilize.trust import UntrustedFile

    try:
        if args.bisect or args.data:
            return (data_main if args.data else precision_main)(args.bundle)
        out = replay(args.bundle)
    except (BadBundle, UntrustedFile) as e:
        print(f"stabilize-replay: {e}", file=sys.stderr)
        return EXIT_CONFIG
    lines = report(args.bundle, out)
    print("\n".join(lines))
    return 0 if lines[-1].endswith("yes") else 1


if __name__ == "__main__":
    sys.exit(main())
