"""Issue 36, "Done when" 1: a user's LightningModule around Hugging Face's GPT2LMHeadModel
(tests/your_lm.py: no stabilize import) trains under ``stabilize.StabilityCallback`` on a
real Trainer. A transient NaN planted in block 1 at step 6 is rolled back and the run ends
at its max_steps with a healthy loss; a NaN planted by content recurs. Each bundle is
replayed by ``stabilize-replay`` in a fresh process, which rebuilds the module from its
import path and saved hyperparameters."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import stabilize

pytest.importorskip("transformers")

from your_lm import GPT2LM, loader, nan_once  # noqa: E402

HERE = Path(__file__).parent
STEPS = 12


def _fit(tmp_path: Path, module, data, **kw):
    cb = stabilize.StabilityCallback(rollback={"snapshot_every": 2}, run_dir=tmp_path / "run", **kw)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb],
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, data)
    return cb, trainer


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _replay(bundle: Path, *flags: str, trust: bool = True) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "stabilize-replay"
    env = {**os.environ, "PYTHONPATH": str(HERE)}  # where your_lm lives, as a user's package
    # --trust-code: the user chooses to import the module the bundle names (your_lm:GPT2LM)
    trusted = ["--trust-code"] if trust else []
    return subprocess.run([str(exe), *trusted, *flags, str(bundle)], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


def _first_loss(tmp_path: Path) -> float:
    """Step 1's loss of the same model and data, no fault (the healthy reference)."""
    torch.manual_seed(0)
    m = GPT2LM()
    x, y = next(iter(loader()))
    with torch.no_grad():
        logits = m.model(input_ids=x).logits
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_a_transient_nan_in_block_1_is_rolled_back_and_its_bundle_does_not_reproduce(tmp_path):
    torch.manual_seed(0)
    module = GPT2LM()
    module.model.transformer.h[1].register_forward_hook(nan_once(6, (0, 3, 5)))  # step 6
    cb, trainer = _fit(tmp_path, module, loader())
    run = tmp_path / "run"
    events = _events(run)
    faults = [e for e in events if e["kind"] == "rollback" and e["monitor"] != "rollback"]
    rolled = [e for e in events if e["monitor"] == "rollback"]
    assert [e["step"] for e in faults] == [6], events
    assert faults[0]["extra"]["class"] == "transient"
    # the step's re-run (the hook fires once) was finite: that is what made it transient
    assert math.isfinite(faults[0]["extra"]["replay"]["loss"])
    assert faults[0]["extra"]["localization"][0]["note"] == "the forward was finite"
    assert len(rolled) == 1 and rolled[0]["extra"]["restored_step"] == 4
    assert cb.host.train_state.model_step == STEPS  # the model's budget, not Lightning's
    assert trainer.global_step > STEPS  # Lightning counted the undone steps too
    assert math.isfinite(cb.last.loss) and cb.last.loss < _first_loss(tmp_path) - 0.5
    r = _replay(run / "bundles" / "step-000006-nonfinite")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "reproduces: no" in r.stdout
    assert "forward: finite" in r.stdout  # the planted hook is not part of the module
    # the flag the docs name is the gate: without it the module is named, not imported
    r = _replay(run / "bundles" / "step-000006-nonfinite", trust=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip() == (
        "stabilize-replay: cannot rebuild the module: replaying it imports module "
        "your_lm:GPT2LM, named by its meta.json; a bundle's files never choose code to run: "
        "pass --trust-code to import them, or --factory pkg.mod:fn to name your own"
    )


def test_a_nan_planted_by_content_is_found_again_and_its_bundle_reproduces(tmp_path):
    torch.manual_seed(0)
    module = GPT2LM(poison_token=255)
    # sequence 44 is in batch 5 (8 per batch): step 6's, once in the run's 14 batches of 16
    cb, _ = _fit(tmp_path, module, loader(poison_at=[44]))
    run = tmp_path / "run"
    faults = [e for e in _events(run) if e["kind"] == "rollback" and e["monitor"] != "rollback"]
    assert [e["step"] for e in faults] == [6]
    # the same batch fails again from the same weights, the step before's does not
    assert faults[0]["extra"]["class"] == "data"
    assert cb.host.train_state.model_step == STEPS and math.isfinite(cb.last.loss)
    meta = json.loads((run / "bundles" / "step-000006-nonfinite" / "meta.json").read_text())
    assert meta["host"]["module"] == "your_lm:GPT2LM"
    assert meta["host"]["hparams"]["poison_token"] == 255
    r = _replay(run / "bundles" / "step-000006-nonfinite")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reproduces: yes" in r.stdout
    assert "first non-finite output in transformer.wte" in r.stdout
    # or the user names their own class: the same step, without trusting the bundle's names
    mine = _replay(run / "bundles" / "step-000006-nonfinite", "--factory", "your_lm:GPT2LM",
                   trust=False)  # fmt: skip
    assert mine.returncode == 0 and mine.stdout == r.stdout, mine.stdout + mine.stderr
    # --data in a fresh process: of the step's 8 rows, sequence 44 alone (row 4 of the
    # loader's batch 5, counted from 0), named by the content of the dataset's own row;
    # 4 replays by hand: the whole step, rows 0-3 (clear), rows 4-5 (fail), row 4 (fail)
    from stabilize.replay.bisect import row_hash

    r = _replay(run / "bundles" / "step-000006-nonfinite", "--data")
    assert r.returncode == 0, r.stdout + r.stderr
    x, y = loader(poison_at=[44]).dataset[44]
    want = (f"data bisection over 8 sequences, 4 replays: the step fails with 1 of them: "
            f"row 4 of the loader's batch 5 (counted from 0 over the run; rank 0; content "
            f"hash {row_hash([x[None], y[None]], 0)})")  # fmt: skip
    assert r.stdout.splitlines()[0] == want, r.stdout
    (item,) = json.loads((run / "skipped_items.json").read_text())["items"]
    assert (item["data_step"], item["row"], item["index"]) == (5, 4, None)
    assert "does not skip them: drop them from your data" in r.stdout


def test_a_bundle_whose_module_cannot_be_rebuilt_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    _fit(tmp_path, GPT2LM(poison_token=255), loader(poison_at=[44]))
    bundle = tmp_path / "run" / "bundles" / "step-000006-nonfinite"
    exe = Path(sys.executable).parent / "stabilize-replay"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # your_lm not importable
    r = subprocess.run([str(exe), "--trust-code", str(bundle)], capture_output=True, text=True,
                       env=env,
                       cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot rebuild the module" in lines[0]
    assert "your_lm:GPT2LM" in lines[0] and "No module named 'your_lm'" in lines[0]


def test_a_resumed_run_goes_on_from_its_model_step(tmp_path):
    """Lightning's checkpoint carries the callback's state: the model steps (and data
    position) of a module we did not write continue from where the first launch stopped,
    and the model's budget still counts model steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(max_steps, ckpt=None):
        torch.manual_seed(0)
        cb = stabilize.StabilityCallback(run_dir=tmp_path / "run")
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[cb, saver], default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(GPT2LM(), loader(), ckpt_path=ckpt)
        return cb, trainer

    cb, _ = fit(5)
    assert cb.host.train_state.model_step == 5
    cb2, trainer2 = fit(9, str(tmp_path / "ckpt" / "last.ckpt"))
    assert cb2.host.train_state.model_step == 9
    assert cb2.host.train_state.data_step == 9  # 9 micro-batches trained on, in all
    assert trainer2.global_step == 9


@pytest.mark.slow  # 20 s; the one-process rollback of this module stays in the default suite
def test_under_ddp_a_transient_nan_on_one_rank_rolls_every_rank_back_together(tmp_path):
    """torchrun, 2 ranks, gloo: the NaN planted on rank 1 at step 4 is seen by both ranks
    (one gathered vector), classified transient and blamed on rank 1; both roll back to the
    same step, end at the model's budget and hold the same weights."""
    from conftest import torchrun

    run = tmp_path / "run"
    torchrun("your_model_ddp_worker.py", str(run), cwd=tmp_path)
    ranks = json.loads((run / "ranks.json").read_text())
    assert [r["model_step"] for r in ranks] == [8, 8]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP replicas stayed equal
    events = _events(run)
    (fault,) = [e for e in events if e["kind"] == "rollback" and e["monitor"] != "rollback"]
    assert (fault["step"], fault["extra"]["class"], fault["extra"]["ranks"]) == (
        4, "transient", [1],
    )  # fmt: skip
    (rolled,) = [e for e in events if e["monitor"] == "rollback"]
    assert rolled["extra"]["restored_step"] == 2


class _Recording(GPT2LM):
    """GPT2LM that remembers each training_step's loss, as the module itself computed it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.append(float(loss.detach()))
        return loss


def test_the_step_loss_is_the_modules_own_under_fp16_scaling_and_accumulation(tmp_path):
    """Lightning hands on_before_backward the loss divided by accumulate_grad_batches and
    multiplied by the GradScaler's scale: the callback undoes both, so the loss the monitors
    judge is the mean of the module's own micro-batch losses (the scale is a power of 2)."""
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)
    module = _Recording()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    cb = stabilize.StabilityCallback(run_dir=tmp_path / "run")
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, accumulate_grad_batches=2,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])  # fmt: skip
    trainer.fit(module, loader())
    assert cb.host.precision_name == "fp16-mixed"
    assert len(module.seen) == 6 and cb.host.train_state.model_step == 3
    want = (module.seen[-2] + module.seen[-1]) / 2
    assert cb.last.loss == pytest.approx(want, rel=1e-6)
    assert cb.last.loss_scale is not None and cb.last.loss_scale > 1


def test_the_users_own_loggers_get_the_per_layer_series_by_the_models_paths(tmp_path):
    """The callback logs through the Trainer's loggers, the user's own: a real offline W&B
    run and a CSVLogger get the per-layer series under the model's own module paths, and
    stabilize-report reads the CSV where the callback's run dir (the Trainer's log dir, by
    default) holds it."""
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from stabilize.report import main as report_main
    from stabilize.wandb_offline import find_offline_runs, read_offline_run

    torch.manual_seed(0)
    wandb = WandbLogger(save_dir=tmp_path, mode="offline", project="mine", anonymous=None)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    cb = stabilize.StabilityCallback()  # run dir: the Trainer's log dir (the first logger's)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", log_every_n_steps=2,
                        logger=[csv_logger, wandb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(GPT2LM(), loader())
    wandb.experiment.finish()
    assert cb.run_dir == Path(csv_logger.log_dir)
    (offline,) = find_offline_runs(tmp_path / "wandb")
    run = read_offline_run(offline, wait_s=30)
    keys = set().union(*(row.keys() for row in run.history))
    # 2 blocks: no prefix passes layer_panels=24, every key keeps its own automatic panel
    assert not [m for m in run.metrics if m["hidden"]] and not any("layers/" in k for k in keys)
    for key in ("act/transformer.h.1", "act/transformer.h.0.ln_1", "train/loss_step",
                "grad_norm/transformer.h.0", "attn_logit/transformer.h.1.attn"):  # fmt: skip
        assert key in keys, sorted(keys)
    assert report_main([str(cb.run_dir)]) == 0
    (arm,) = json.loads((cb.run_dir / "report" / "summary.json").read_text())
    assert (arm["status"], arm["precision"], arm["steps"]) == ("done", "fp32", 4)


class _Manual(GPT2LM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("module", "kw", "words"),
    [
        (_Manual, {}, "_Manual: manual optimization is not supported by StabilityCallback"),
        (GPT2LM, {"fault": {"kind": "nan_loss", "step": 2}},
         "fault.kind='nan_loss' acts on the loss, which this loop computes itself"),
    ],
)  # fmt: skip
def test_what_the_callback_cannot_watch_is_refused_in_one_line(tmp_path, module, kw, words):
    from stabilize.stability.driven import StabilityConfigError

    torch.manual_seed(0)
    cb = stabilize.StabilityCallback(run_dir=tmp_path / "run", **kw)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])  # fmt: skip
    with pytest.raises(StabilityConfigError) as err:
        trainer.fit(module(), loader())
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_module_defined_in_a_script_is_refused_by_the_replay_and_warned_of_in_training(
    tmp_path, capsys
):
    """A bundle naming ``__main__:Class`` cannot be rebuilt elsewhere: the replay's one line
    says what to do; the callback says so at set-up, before any bundle exists."""
    from stabilize.replay.rebuild import CannotRebuild, rebuild_module

    with pytest.raises(CannotRebuild, match=r"__main__:MyLM is defined in a script; move it to "
                       r"a module or give StabilityCallback\(factory='pkg.mod:fn'\)"):  # fmt: skip
        rebuild_module({"kind": "lightning", "module": "__main__:MyLM", "hparams": {}})
    script = tmp_path / "train_here.py"
    script.write_text(
        "import lightning as L, torch, stabilize, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from your_lm import GPT2LM, loader\n"
        "class MyLM(GPT2LM):\n    pass\n"
        "cb = stabilize.StabilityCallback(run_dir='run')\n"
        "L.Trainer(max_steps=1, accelerator='cpu', logger=False, enable_checkpointing=False,"
        " enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])"
        ".fit(MyLM(), loader())\n"
    )
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("[stability] __main__:MyLM is defined in a script: its repro bundles cannot be "
            "replayed in another process") in r.stdout  # fmt: skip
