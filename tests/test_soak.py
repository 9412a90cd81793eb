"""The fault soak (scripts/soak.py), small: one 2-rank job (a NaN planted) interrupted at
random by SIGKILL, SIGTERM and SIGSTOP of its ranks and requeued as a scheduler would, then
its twin run uninterrupted. The job ends done, on weights and AdamW moments bitwise equal to
the twin's, with the same held-out loss. Slow (~2 min on 2 cores): the figures in
docs/operations.md come from the full command."""

from __future__ import annotations

import json
import sys

import pytest
from doc_commands import doc_command

from conftest import ROOT, run_cli


@pytest.mark.slow
def test_a_small_soak_ends_bitwise_equal_to_its_uninterrupted_twin(tmp_path):
    out = tmp_path / "soak.json"
    shown = doc_command("soak").split()  # as docs/operations.md shows it, its size shrunk
    assert shown[:2] == ["python", "scripts/soak.py"]
    r = run_cli([sys.executable, str(ROOT / shown[1]), *shown[2:], "--jobs", "nan_loss",
                 "--steps", "40", "--every", "5", "--hang", "6", "--gap", "5", "--seed", "1",
                 "--out", str(tmp_path / "runs"), "--json", str(out)], cwd=tmp_path,
                timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(out.read_text())
    (row,) = figures["rows"]
    assert row["done"] and row["bitwise"] and not row["human"], row
    assert row["interruptions"] >= 1 and row["loss"] == row["twin_loss"]
    for e in figures["events"]:  # every interruption was followed by training again
        assert e["restart_s"] > 0 and e["lost"] >= 0, e
    assert "| nan_loss |" in r.stdout
