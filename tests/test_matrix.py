"""Every registered norm type x placement x precision trains to the end and leaves its run
files. A crash at the end of a run (ScaleNorm's 0-dim gain in the replica digest, which
left no ``replicas.json`` and no ``checkpoints/``) cannot land again unnoticed.

The default suite runs a pairwise cover (every pair of values of any two axes appears in
some run: 16 runs instead of 48); ``-m slow`` runs the whole product. The axes are read
from the registries, so a type registered later is covered without editing this file."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from stabilize.norms import NORM_TYPES
from stabilize.norms.config import PLACEMENTS
from stabilize.run.config import PRECISIONS
from stabilize.train import run

from conftest import FAST, compose_run

AXES = (tuple(NORM_TYPES), PLACEMENTS, PRECISIONS)


def pairwise(axes):
    """A greedy strength-2 covering array: rows of the product until every pair of values
    of every two axes is in some row. Deterministic (product order, first best row)."""

    def pairs(row):
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}

    todo = set().union(*(pairs(r) for r in itertools.product(*axes)))
    rows = []
    candidates = list(itertools.product(*axes))
    while todo:
        best = max(candidates, key=lambda r: len(pairs(r) & todo))
        rows.append(best)
        todo -= pairs(best)
    return rows


def test_the_pairwise_cover_covers_every_pair():
    rows = pairwise(AXES)
    for (i, a), (j, b) in itertools.combinations(enumerate(AXES), 2):
        for x, y in itertools.product(a, b):
            assert any(r[i] == x and r[j] == y for r in rows), (x, y)
    assert len(rows) < math.prod(len(a) for a in AXES)


def _trains_to_the_end(tmp_path, norm, placement, precision):
    overrides = [
        f"norm.type={norm}",
        f"norm.placement={placement}",
        f"precision={precision}",
        *FAST,
        "trainer.max_steps=2",
        "logger=none",
    ]
    out = run(compose_run(tmp_path, overrides))
    assert out["model_step"] == 2
    assert math.isfinite(out["metrics"]["train/loss"])
    replicas = json.loads((tmp_path / "replicas.json").read_text())
    assert replicas["identical"] is True and replicas["ranks"][0]["model_step"] == 2
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "done"


@pytest.mark.parametrize("norm,placement,precision", pairwise(AXES))
def test_pairwise_matrix_trains_to_the_end(norm, placement, precision, tmp_path):
    _trains_to_the_end(tmp_path, norm, placement, precision)


@pytest.mark.slow
@pytest.mark.parametrize("norm,placement,precision", list(itertools.product(*AXES)))
def test_full_matrix_trains_to_the_end(norm, placement, precision, tmp_path):
    _trains_to_the_end(tmp_path, norm, placement, precision)
