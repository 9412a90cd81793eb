"""Faults and tools that say what happened (issue 34 item 5).

- The docs' ``poisoned_item`` example runs as written and fires where the sampler's own
  order puts the block; its bundle's ``--data`` replay names the block, and ``--bisect`` on
  that fp32 bundle says there is no 16-bit norm to bisect (not "does not fail") and points
  to ``--data``.
- An armed fault that never fires says so at the end (the summary and result.json); the
  reference is the sampler: the block is in none of the run's batches.
- A ``fault.item`` outside the corpus is refused before anything is written (no run dir,
  no W&B run); the reference is the corpus's own number of training blocks.

Every run is the real ``stabilize-train`` app (Hydra, Lightning) in this process.
"""

from __future__ import annotations

import glob
import json
import shlex
from pathlib import Path

import pytest
from doc_commands import doc_command

from stabilize.data import build_dataloaders
from stabilize.replay import main as replay_main

from conftest import compose_run, train_cli


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime ("nothing written": an equal tree)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}  # fmt: skip


def refusal(err: str) -> str:
    """The one line of a refusal (and nothing else on stderr)."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("stabilize-train: "), err
    return lines[0]


def train(args, cwd, monkeypatch, capsys) -> tuple[int, str, str]:
    """``stabilize-train ARGS`` in this process, in ``cwd``: (exit code, stdout, stderr)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    r = train_cli(args, cwd, monkeypatch, capsys)
    return r.returncode, r.stdout, r.stderr


def expand(args: list[str], cwd: Path) -> list[str]:
    """A shell's glob expansion of the arguments, in ``cwd``."""
    out = []
    for a in args:
        hits = sorted(glob.glob(str(cwd / a))) if any(ch in a for ch in "*?[") else []
        out += [str(Path(h).relative_to(cwd)) for h in hits] or [a]
    return out


def draws(overrides: list[str], item: int, steps: int, tmp_path) -> list[tuple[int, int]]:
    """(data position, row) of every draw of block ``item`` in the first ``steps`` batches
    of the sampler these settings build: the reference for where the fault must fire."""
    cfg = compose_run(tmp_path / "probe", overrides)
    loader, _ = build_dataloaders(cfg.data, cfg.model.block_size, num_steps=None)
    rows = (loader.batch_sampler.batch_for_step(p) for p in range(steps))
    return [(p, b.index(item)) for p, b in enumerate(rows) if item in b]


def test_the_docs_poisoned_item_example_fires_and_its_bundle_replays_as_said(
    tmp_path, monkeypatch, capsys
):
    run_cmd = shlex.split(doc_command("poisoned-item"))
    assert run_cmd[0] == "stabilize-train"
    args = run_cmd[1:]
    ((position, row),) = draws(args, 117, 8, tmp_path)  # drawn once in the run's 8 steps
    code, out, err = train([*args, "logger=none"], tmp_path, monkeypatch, capsys)  # as written
    assert code == 0, err[-3000:]
    (run_dir,) = (tmp_path / "runs" / "main").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["fault"]["kind"] == "poisoned_item" and result["fault"]["fired"] is True
    assert "never fired" not in out
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (rb,) = [e for e in events if e["kind"] == "rollback" and e["monitor"] == "nonfinite"]
    assert rb["step"] == position + 1 and rb["extra"]["class"] == "data"
    bundle = run_dir / "bundles" / f"step-{position + 1:06d}-nonfinite"
    assert bundle.is_dir()

    replay_cmd = shlex.split(doc_command("poisoned-item-replay"))
    assert replay_cmd[0] == "stabilize-replay"
    replay_args = expand(replay_cmd[1:], tmp_path)
    assert replay_args[-1] == str(bundle.relative_to(tmp_path))  # the glob finds the bundle
    capsys.readouterr()
    assert replay_main(replay_args) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert ": block 117 (hash " in head and f"data position {position}, row {row})" in head

    # the same bundle, plain: it reproduces; --bisect: the run's norms are all fp32
    assert replay_main([str(bundle)]) == 0
    assert capsys.readouterr().out.strip().endswith("yes")
    assert replay_main(["--bisect", str(bundle)]) == 1
    said = capsys.readouterr().out
    assert "does not fail in the replay" not in said
    assert "no 16-bit norm to bisect" in said and f"stabilize-replay --data {bundle}" in said


def test_an_armed_fault_that_never_fires_says_so_at_the_end(tmp_path, monkeypatch, capsys):
    """The docs' example stopped at step 5, before the block's draw at data position 5 (the
    issue's run was the same fault on the whole corpus, where it is first drawn at 416)."""
    args = [*shlex.split(doc_command("poisoned-item"))[1:], "trainer.max_steps=5"]
    args += ["logger=none", "trainer.final_eval_batches=2"]
    assert draws(args, 117, 5, tmp_path) == []  # the reference: never drawn in 5 steps
    code, out, err = train(args, tmp_path, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    (run_dir,) = (tmp_path / "runs" / "main").iterdir()
    fault = json.loads((run_dir / "result.json").read_text())["fault"]
    assert fault["kind"] == "poisoned_item" and fault["fired"] is False
    assert "training block 117" in fault["trigger"]
    (line,) = [x for x in out.splitlines() if "never fired" in x]
    assert line.startswith("fault poisoned_item was armed but never fired: it fires when ")
    assert "block 117" in line


@pytest.mark.parametrize("enabled", ["true", "false"])
def test_a_fault_item_outside_the_corpus_is_refused_before_anything_is_written(
    enabled, tmp_path, monkeypatch, capsys
):
    probe = compose_run(tmp_path / "probe", ["data.max_chars=20000"])
    loader, _ = build_dataloaders(probe.data, probe.model.block_size, num_steps=None)
    n = len(loader.dataset)  # the reference: the corpus's training blocks
    args = ["data.max_chars=20000", "fault=poisoned_item", f"fault.item={n}"]
    args += [f"fault.enabled={enabled}", "trainer.max_steps=2"]  # W&B on (offline): no run
    before = tree(tmp_path)
    code, out, err = train(args, tmp_path, monkeypatch, capsys)
    line = refusal(err)
    assert code == 2, err
    assert f"fault.item={n} is not allowed" in line and f"[0, {n})" in line, line
    assert tree(tmp_path) == before  # no runs/, no wandb/, no .hydra/
