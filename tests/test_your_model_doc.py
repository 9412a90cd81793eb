"""docs/your-model.md runs as written (issue 36, "Done when" 5): its python blocks are
written to the files their first line names (``# file: mylm.py``), the scripts run in a
fresh process in a temporary directory, and what each prints is the ``text`` block that
follows it in the doc; then the doc's ``stabilize-replay`` command runs as written there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from doc_commands import ROOT, doc_command
from packaging.requirements import Requirement

pytest.importorskip("transformers")

DOC = ROOT / "docs" / "your-model.md"
_BLOCK = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(DOC.read_text())]


def _files_and_outputs() -> tuple[dict[str, str], dict[str, str]]:
    """{file name: code}, and {script: the text block right after it}."""
    files, outputs, blocks = {}, {}, _blocks()
    for i, (lang, body) in enumerate(blocks):
        first = body.splitlines()[0]
        if lang == "python" and first.startswith("# file: "):
            name = first.removeprefix("# file: ").strip()
            files[name] = body
            if i + 1 < len(blocks) and blocks[i + 1][0] == "text":
                outputs[name] = blocks[i + 1][1]
    return files, outputs


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": str(cwd), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_lightning_example_prints_what_the_doc_says_and_its_bundle_replays(tmp_path):
    files, outputs = _files_and_outputs()
    assert {"mylm.py", "train_mylm.py", "inspect_mylm.py"} <= set(files)
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    for script in ("train_mylm.py", "inspect_mylm.py"):
        _prints(script, outputs[script], tmp_path)
    r = _run(shlex.split(doc_command("replay-mylm")), tmp_path)  # as written in the doc
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "reproduces: no"


def _prints(script: str, want: str, cwd: Path) -> None:
    """The script's own lines are the doc's (the harness's console lines, ``[...]``, aside)."""
    r = _run([sys.executable, script], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    own = [x for x in r.stdout.strip().splitlines() if not x.startswith("[")]
    assert own[-len(want.strip().splitlines()) :] == want.strip().splitlines(), r.stdout


def test_the_guard_example_prints_what_the_doc_says_and_its_bisection_names_the_norms(
    tmp_path,
):
    files, outputs = _files_and_outputs()
    for name in ("myllama.py", "train_guard.py"):
        (tmp_path / name).write_text(files[name])
    _prints("train_guard.py", outputs["train_guard.py"], tmp_path)
    r = _run(shlex.split(doc_command("bisect-guard")), tmp_path)  # as written in the doc
    assert r.returncode == 0, r.stdout + r.stderr
    blocks = [b for lang, b in _blocks() if lang == "text"]
    assert r.stdout.strip() + "\n" in blocks, r.stdout


def test_the_hf_trainer_example_prints_what_the_doc_says_and_its_bundle_replays(tmp_path):
    files, outputs = _files_and_outputs()
    for name in ("myllama.py", "train_hf.py"):
        (tmp_path / name).write_text(files[name])
    _prints("train_hf.py", outputs["train_hf.py"], tmp_path)
    r = _run(shlex.split(doc_command("replay-hf-trainer")), tmp_path)  # no flag: by registry
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "reproduces: no"


def test_the_hf_extra_the_doc_installs_is_declared_and_met_here():
    assert doc_command("hf-extra").endswith("-e '.[hf]'")
    reqs = [Requirement(r) for r in requires("stabilize") or []]
    hf = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "hf"})]
    hf = [r for r in hf if not r.marker.evaluate({"extra": ""})]
    assert [r.name for r in hf] == ["transformers", "accelerate"]  # the Trainer needs both
    assert all(version(r.name) in r.specifier for r in hf)
