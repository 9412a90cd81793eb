"""``stabilize-replay BUNDLE``: replay a failing step from its repro bundle, in this process.

    stabilize-replay runs/x/bundles/step-000004-nonfinite            # does it reproduce?
    stabilize-replay --bisect runs/x/bundles/step-000004-overflow    # the norms to switch
    stabilize-replay --data runs/x/bundles/step-000006-nonfinite     # the sequences to skip

``cli.py`` is the command; ``core.py`` checks the bundle and replays the step (optionally
with norms switched to fp32, or with a subset of its sequences); ``bisect.py`` halves over
either. Exit 0: it reproduces
(a bisection: found); 1: it does not (nothing found); 2: a bad bundle, one line.
"""

from stabilize.replay.cli import main
from stabilize.replay.core import TOLERANCE, BadBundle, check, fails, replay, report

__all__ = ["TOLERANCE", "BadBundle", "check", "fails", "main", "replay", "report"]
