"""``stabilize-replay --gap / --tail / --spike`` and ``stabilize-gap`` on dirs that are not
finished runs of ours: each is refused in one line naming the dir and what it lacks, exit 2,
nothing written (report/gap.py ``run_dir_problem``). The dirs are real: tiny runs trained
here, one stopped early by ``trainer.stop_at_step``, one preempted by a real SIGTERM before
its end, one whose step checkpoint is cut short, a run of a user's own loop under the
stability callback (judged, not replayed), and dirs of someone else's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics

import lightning as L
import pytest
import torch

from stabilize.exits import EXIT_CONFIG
from stabilize.replay.cli import main as replay_main
from stabilize.report.gap_cli import main as gap_main
from stabilize.train import run

from conftest import FAST, compose_run

# 4 steps, a checkpoint at 2, no validation, one held-out batch
TINY = [*FAST, "precision=fp32", "trainer.checkpoint_every_n_steps=2",
        "trainer.val_check_interval=100", "trainer.final_eval_batches=1"]  # fmt: skip


class _SigtermAt3(L.Callback):
    """A preemption as a scheduler sends it, at model step 3 of 4: the run checkpoints,
    writes result.json "preempted" and stops, with no final eval."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        if pl_module.train_state.model_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


class _OwnLM(L.LightningModule):
    """A user's own module, trained under the stability callback on their Trainer."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = torch.nn.Embedding(32, 16), torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 32)

    def training_step(self, batch, i):
        x, y = batch
        logits = self.head(self.ln(self.emb(x)))  # (B, T, V) -> (B*T, V) below
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _own_loop_run(run_dir) -> None:
    from lightning.pytorch.loggers import CSVLogger

    import stabilize

    torch.manual_seed(0)
    x = torch.randint(0, 32, (16, 8))
    data = torch.utils.data.DataLoader(list(zip(x, x.roll(1, 1), strict=True)), batch_size=4)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", enable_checkpointing=False,
                        logger=CSVLogger(run_dir, name="", version=""), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[stabilize.StabilityCallback(run_dir=run_dir)])  # fmt: skip
    trainer.fit(_OwnLM(), data)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay_errors")
    run(compose_run(root / "good", [*TINY, "seed=1"]))
    for seed in (2, 3, 4):  # good and s2, s3: three reference seeds; s4 one more of them
        run(compose_run(root / f"s{seed}", [*TINY, f"seed={seed}"]))
    # the same seed at 100x the learning rate: a held-out gap far outside the seeds' band
    run(compose_run(root / "far", [*TINY, "seed=1", "optim.lr=3e-2"]))
    run(compose_run(root / "short", [*TINY, "seed=1", "trainer.stop_at_step=2"]))
    with pytest.raises(Exception, match="preempted by SIGTERM at model step 3"):
        run(compose_run(root / "killed", [*TINY, "seed=1"]), [_SigtermAt3()])
    # a SIGKILL leaves what a preemption does, less result.json (only a live process writes it)
    shutil.copytree(root / "killed", root / "sigkilled")
    (root / "sigkilled" / "result.json").unlink()
    shutil.copytree(root / "good", root / "damaged")  # its step-2 checkpoint cut in half
    ckpt = root / "damaged" / "checkpoints" / "step-000002.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    _own_loop_run(root / "own")
    (root / "hf").mkdir()  # a Hugging Face model dir: a config.json that is not ours
    (root / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (root / "junk").mkdir()  # random files, no config.json
    (root / "junk" / "notes.txt").write_text("not a run\n")
    (root / "garbled").mkdir()  # a config.json cut short
    (root / "garbled" / "config.json").write_text('{"model": {"n_layer": ')
    (root / "cwd").mkdir()
    return root


def _tree(root) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}  # fmt: skip


# (command, its argv with {d} the fixture's root, the words its one line holds)
CASES = [
    ("replay", "--tail 2 {d}/short --reference {d}/good {d}/good",
     "{d}/short: not a finished run (it stopped at model step 2 of trainer.max_steps=4, at "
     "trainer.stop_at_step=2)"),
    ("replay", "--tail 2 {d}/killed --reference {d}/good {d}/good",
     "{d}/killed: not a finished run (result.json: status preempted at model step 3 of "
     "trainer.max_steps=4; no final_eval.json to compare held out)"),
    ("replay", "--tail 2 {d}/sigkilled --reference {d}/good {d}/good",
     "{d}/sigkilled: not a finished run (no result.json: killed before its end, or still "
     "training; no final_eval.json to compare held out)"),
    ("replay", "--tail 2 {d}/hf --reference {d}/good {d}/good",
     "{d}/hf: not a run dir (its config.json is not a stabilize run's: no model, data, "
     "optim, precision, trainer, logger sections)"),
    ("replay", "--tail 2 {d}/junk --reference {d}/good {d}/good",
     "{d}/junk: not a run dir (no config.json)"),
    ("replay", "--tail 2 {d}/own --reference {d}/good {d}/good",
     "{d}/own: not a stabilize-train run (its config.json is the stability callback's, on a "
     "loop of the user's): a replay rebuilds stabilize-train's runs only"),
    ("replay", "--tail 2 {d}/garbled --reference {d}/good {d}/good",
     "{d}/garbled: not a run dir (config.json unreadable: Expecting value"),
    ("replay", "--tail 3 {d}/good --reference {d}/good {d}/good",
     "--tail=3 is not allowed: {d}/good has no checkpoint at model step 3; allowed: 0 (its "
     "initial state) or a step it kept a checkpoint at: 2"),
    ("replay", "--tail 4 {d}/good --reference {d}/good {d}/good",
     "--tail=4 is not allowed: {d}/good ends at model step 4, nothing after it to retrain"),
    ("replay", "--tail 2 {d}/damaged --reference {d}/good {d}/good",
     "{d}/damaged/checkpoints/step-000002.ckpt is not a whole checkpoint ("),
    ("replay", "--tail 2 {d}/good --reference {d}/good",
     "--tail needs 2 or more --reference run dirs (their seed noise bounds the share"),
    ("replay", "--tail 2 {d}/good --reference {d}/good {d}/killed",
     "--reference {d}/killed: not a finished run (result.json: status preempted"),
    ("replay", "--gap {d}/short --reference {d}/good {d}/good",
     "{d}/short: not a finished run (it stopped at model step 2"),
    ("replay", "--gap {d}/hf --reference {d}/good {d}/good", "{d}/hf: not a run dir ("),
    ("replay", "--gap {d}/killed --reference {d}/good {d}/good",
     "{d}/killed: not a finished run (result.json: status preempted"),
    ("replay", "--gap {d}/good --reference {d}/good {d}/hf", "--reference {d}/hf: not a run dir"),
    ("replay", "--spike {d}/hf --at 2", "{d}/hf: not a run dir ("),
    ("replay", "--spike {d}/good --at 2 --reference {d}/good {d}/short",
     "--reference {d}/short: not a finished run (it stopped at model step 2"),
    ("replay", "--spike {d}/good --at 4",
     "--at=4 is not allowed: {d}/good ends at model step 4, no step after it to replay; "
     "allowed: --at a model step from 1 to 3"),
    ("gap", "{d}/good --reference {d}/good {d}/hf",
     "--reference {d}/hf: not a run dir (its config.json is not a stabilize run's"),
    ("gap", "{d}/good --reference {d}/good {d}/killed",
     "--reference {d}/killed: not a finished run (result.json: status preempted"),
    ("gap", "{d}/good --reference {d}/good {d}/short",
     "--reference {d}/short: not a finished run (it stopped at model step 2"),
    ("gap", "{d}/good --reference {d}/good {d}/junk", "--reference {d}/junk: not a run dir (no "
     "config.json)"),
    ("gap", "{d}/sigkilled --reference {d}/good {d}/good",
     "{d}/sigkilled: not a finished run (no result.json"),
]  # fmt: skip


MAINS = {"replay": (replay_main, "stabilize-replay"), "gap": (gap_main, "stabilize-gap")}


@pytest.mark.parametrize(("command", "argv", "words"), CASES,
                         ids=[f"{c} {a.replace('{d}/', '')}" for c, a, _ in CASES])  # fmt: skip
def test_a_dir_that_is_no_finished_run_is_refused_in_one_line(
    dirs, command, argv, words, capsys, monkeypatch
):
    monkeypatch.chdir(dirs / "cwd")  # what a refused command writes in its cwd shows too
    before = _tree(dirs)
    main, prog = MAINS[command]
    capsys.readouterr()
    assert main(argv.format(d=dirs).split()) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: {words.format(d=dirs)}"), err
    assert _tree(dirs) == before  # nothing written: no gap/ dir, no replay's files


def test_finished_runs_of_ours_pass_the_same_checks(dirs, tmp_path, capsys):
    """The checks refuse the dirs above, not real runs: stabilize-gap judges a copy of the
    run against the run itself twice (no seed noise to measure: exit 1), and a run of the
    user's own loop likewise; the tail of a run with a real gap, from the step-2 checkpoint,
    replays the rest of the run and keeps what it found."""
    run_dir = tmp_path / "far"
    shutil.copytree(dirs / "far", run_dir)
    for d, refs in ((run_dir, [dirs / "good"] * 2), (dirs / "own", [dirs / "own"] * 2)):
        out = tmp_path / d.name
        assert gap_main([str(d), "--reference", *map(str, refs), "--out", str(out)]) == 1
        assert json.loads((out / "gap.json").read_text())["reference"] == list(map(str, refs))
    refs = [str(dirs / s) for s in ("good", "s2", "s3")]
    capsys.readouterr()
    assert replay_main(["--tail", "2", str(run_dir), "--reference", *refs]) == 0
    out = capsys.readouterr().out
    assert "tail counterfactual: steps 2-4" in out, out
    assert json.loads((run_dir / "gap" / "tail.json").read_text())["start"] == 2


def _words(run_dir, refs) -> str:
    """The judge's words for the held-out gap, by hand from the runs' final_eval.json:
    t(0.975, 2) = 4.302653 with 3 seeds."""
    score = [json.loads((d / "final_eval.json").read_text())["loss"] for d in [run_dir, *refs]]
    gap = score[0] - statistics.fmean(score[1:])
    noise = statistics.stdev(score[1:]) * (4 / 3) ** 0.5
    assert abs(gap) <= 4.302653 * noise  # one more seed of the reference: inside its band
    return (f"held-out loss {gap:+.4f} nats, {gap / noise:+.1f} sigma of seed noise: inside "
            f"the noise (the 3-seed band is +-{4.302653 * noise:.4f})")  # fmt: skip


def test_the_tail_declines_a_gap_inside_the_noise_as_the_gap_bisection_does(dirs, capsys):
    """A fourth seed of the reference is inside its noise: --gap says there is nothing
    significant to close, and --tail, judging by the same rule, claims no share of it: one
    line with the judge's words, exit 1, no replay and nothing written."""
    run_dir, refs = dirs / "s4", [dirs / s for s in ("good", "s2", "s3")]
    before, words = _tree(dirs), _words(run_dir, refs)
    capsys.readouterr()
    assert replay_main(["--tail", "2", str(run_dir), "--reference", *map(str, refs)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "tail counterfactual: nothing significant to recover (the run's gap is not a real gap "
        f"against the reference's seed noise): {words}"
    ]
    assert replay_main(["--gap", str(run_dir), "--reference", *map(str, refs)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"  {words}" and out[-1].startswith("gap bisection: nothing significant")
    assert _tree(dirs) == before  # no replay's files, no gap/tail.json
