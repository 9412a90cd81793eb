"""``stabilize-map``: learning-rate sensitivity per recipe, across seeds (docs/map.md).

A grid of recipes (any config keys) x a log-spaced LR range x seeds, each cell a normal
``stabilize-train`` run with every monitor on and rollback off, launched through Hydra's
multirun with a parallel launcher (``hydra-joblib-launcher`` on one machine,
``hydra-submitit-launcher`` on SLURM). ``spec.py``: what is measured; ``cells.py``: what a
cell measured; ``analysis.py``: per recipe (LR sensitivity, best and largest stable LR);
``claims.py``: the claims it answers; ``report.py``: map.md, map.json and the figures;
``cli.py``: the plan, the launches, the progress.
"""

from stabilize.map.cli import main

__all__ = ["main"]
