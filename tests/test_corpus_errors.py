"""A corpus file that does not parse is refused like every other bad input (issue 34 item 8):
one line naming the file and the line, exit 2, nothing written (no run dir, no wandb/).

The reference is the file the test writes: the line it broke on purpose. The run goes
through the real ``stabilize-train`` app in this process (``tests/test_errors.py``'s
``cli``), with the default logger (W&B offline), so "no wandb dir" is a real check.
"""

from __future__ import annotations

import json

import pytest
from test_errors import cli, one_message, tree

from conftest import FAST

ROWS = [json.dumps({"text": f"document {i}: " + "some words to train on " * 8}) for i in range(300)]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ('{"text": "a string cut by a newline\n', "invalid control character"),
        ('{"text": "no closing brace"\n', "expecting ',' delimiter"),
        ('["a", "list"]\n', "not a JSON object (a list)"),
    ],
    ids=["cut-string", "no-brace", "a-list"],
)
def test_a_broken_jsonl_line_is_named_with_its_file_and_line(
    bad, why, tmp_path, monkeypatch, capsys
):
    broken_at = 58  # 1-based: the line the test breaks
    lines = [r + "\n" for r in ROWS]
    lines[broken_at - 1] = bad
    (tmp_path / "broken.jsonl").write_text("".join(lines))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = tree(tmp_path)
    # the command, shortened; with W&B on, so "no wandb/" is a real check
    args = [*FAST, "logger=wandb", "data=local", "data.paths=[broken.jsonl]"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2, err
    assert f"'broken.jsonl' line {broken_at} " in line and why in line, line
    assert "data.paths=['broken.jsonl']" in line and "allowed:" in line
    assert tree(tmp_path) == before  # no runs/, no wandb/, no .hydra/


def test_a_broken_json_document_names_the_decoders_line(tmp_path, monkeypatch, capsys):
    """A ``.json`` file that is one document (datasets' fallback reader): the line the JSON
    decoder stops at, here the one the test broke."""
    doc = json.dumps([{"text": "x " * 80 + str(i)} for i in range(40)], indent=1).splitlines()
    broken_at = 30
    doc[broken_at - 1] = doc[broken_at - 1].replace('"text"', "text")
    (tmp_path / "doc.json").write_text("\n".join(doc) + "\n")
    before = tree(tmp_path)
    args = [*FAST, "logger=none", "data=local", "data.paths=[doc.json]"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    line = one_message(err)
    assert code == 2 and f"'doc.json' line {broken_at} is not JSON" in line, line
    assert tree(tmp_path) == before
