"""The training state the harness owns has a name (``TrainState``, rollback/state.py): the
module, the callbacks, the controller and the remedies share that one object, and a
checkpoint holds its state dict."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import torch

from stabilize.rollback.state import TrainState
from tests.conftest import compose_run

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name for f in dataclasses.fields(TrainState)} - {"model"}


class _Model(torch.nn.Module):
    z_loss = 0.0


def test_a_state_dict_round_trip_keeps_the_samplers_set_and_steps_over_skipped_positions():
    a = TrainState(_Model(), model_step=7, data_step=12, lr_scale=0.25, lr_since=5)
    a.remedies += ["lower_lr", "lower_lr"]
    a.skipped |= {12, 13, 20}
    a.model.z_loss = 1e-4
    saved = a.state_dict()
    b = TrainState(_Model())
    shared = b.skipped  # the train sampler holds this very set
    shared.add(3)
    b.load_state_dict(saved, z_loss=0.0)
    assert b.skipped is shared and b.skipped == {3, 12, 13, 20}
    # position 12 is skipped, and 13 after it: training resumes at 14 (by hand)
    assert (b.model_step, b.data_step, b.lr_scale, b.lr_since) == (7, 14, 0.25, 5)
    assert b.remedies == ["lower_lr", "lower_lr"] and b.model.z_loss == 1e-4
    old = {k: v for k, v in saved.items() if k != "z_loss"}  # written before z_loss was saved
    c = TrainState(_Model())
    c.load_state_dict(old, z_loss=3e-4)
    assert c.model.z_loss == 3e-4


def test_the_module_keeps_no_copy_of_the_train_state(tmp_path):
    from stabilize.lit.module import GPTLitModule

    m = GPTLitModule(compose_run(tmp_path, ["model=tiny"]))
    assert isinstance(m.train_state, TrainState) and m.train_state.model is m.model
    assert not FIELDS & set(vars(m)), FIELDS & set(vars(m))


def _module_attribute_reads(path: Path, root: Path = ROOT) -> set[str]:
    """``pl_module.<field>`` / ``module.<field>`` for a TrainState field, anywhere in a file."""
    hits = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in FIELDS
            and isinstance(node.value, ast.Name)
            and node.value.id in ("pl_module", "module", "lightning_module")
        ):
            hits.add(f"{path.relative_to(root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return hits


def test_no_code_reaches_past_the_train_state():
    files = [*(ROOT / "stabilize").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    bad = set().union(*(_module_attribute_reads(p) for p in files))
    assert not bad, sorted(bad)


def test_the_reach_check_itself_sees_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "def f(pl_module, module):\n    return pl_module.lr_scale, module.train_state.lr_scale\n"
    )
    assert _module_attribute_reads(f, tmp_path) == {"x.py:2: pl_module.lr_scale"}
