"""What a person sees on the console (issue 16, items 1-3): our lines only, events summarised
(every one still in events.jsonl), a final summary naming every rollback and what the
remedies changed, and step lines on the model's step."""

from __future__ import annotations

import json
import re
import shlex

import lightning as L
import pytest
from doc_commands import doc_command

from stabilize.run.summary import final_summary, read_events
from stabilize.train import run

from conftest import FAST, compose_run, run_cli

# Every line a default run may print: ours (the token cache's log line, the run's one-line
# description, step and validation lines, stability events, the final summary).
OURS = re.compile(
    r"^(\[[^]]+\]\[stabilize\.data\]\[INFO\] - token cache |stabilize-train: |step \d+/\d+  |"
    r"validation @ step \d+  |\[stability\] |done: \d+ steps \(|  rollback \d+ at step |"
    r"ended with: |W&B offline run: |run dir: |final eval: \d+/\d+ batches a rank, eta )"
)
# Third-party lines seen in every run before
NOISE = [
    "GPU available",
    "TPU available",
    "💡 Tip",
    "Total FLOPs",
    "lr_scheduler.step()",
    "wandb: ",
    "anonymous setting",
]


def cli(run_dir, *args):
    # W&B's own console output on (conftest silences it for the other tests)
    r = run_cli(
        [
            "stabilize-train",
            *FAST,
            "logger=wandb",
            "precision=fp16-mixed",
            *args,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=run_dir.parent,
        env={"WANDB_SILENT": "false", "WANDB_MODE": "offline"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return (r.stdout + r.stderr).splitlines()


def test_a_default_run_prints_our_lines_only_and_verbose_shows_the_rest(tmp_path):
    lines = cli(tmp_path / "quiet")
    loud = cli(tmp_path / "loud", "verbose=true")
    # the reference: the same run, verbose, still prints the noise (what quiet.py drops)
    for noise in ("GPU available", "Total FLOPs", "wandb: "):
        assert any(noise in line for line in loud), (noise, loud)
    assert [line for line in lines if not OURS.match(line)] == [], lines
    assert not [line for line in lines if any(n in line for n in NOISE)]
    # 4 steps, log_every 1, validation every 2: the counts follow from the overrides
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/4", "2/4", "3/4", "4/4"]
    for field in ("loss", "grad_norm", "lr", "scale", "tok/s", "eta"):
        assert all(f"  {field} " in s for s in steps), (field, steps)
    assert [v.split()[3] for v in lines if v.startswith("validation")] == ["2", "4"]
    assert any(line.startswith("done: 4 steps (4 asked)") for line in lines)
    stability = [line for line in lines if line.startswith("[stability]")]
    # the final eval's progress line, every 10 s of a long one: only on a loaded machine
    slow_eval = [line for line in lines if line.startswith("final eval: ")]
    # the cache line, the description, 4 steps, 2 validations, done, W&B, run dir
    assert len(lines) == 11 + len(stability) + len(slow_eval), lines
    assert len(loud) > len(lines) + 20


def test_the_description_comes_first_on_a_fresh_machine(tmp_path):
    """The README's one-run command where nothing is cached yet: matplotlib's font cache,
    the token cache and the fused CPU kernel all start from nothing. The description is the
    first line; the token cache's lines and the kernel's notice follow it at once (a kernel
    that cannot be built here: no C++ compiler, so no build is left running), before the
    first step; the font cache says nothing and no line names the cache entry's full path."""
    cmd = [a for a in shlex.split(doc_command("one-run")) if "max_steps" not in a]
    fresh = {"MPLCONFIGDIR": str(tmp_path / "mpl"), "STABILIZE_CACHE_DIR": str(tmp_path / "c"),
             "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(tmp_path / "no-c++"),
             "STABILIZE_KERNEL_WAIT": "0"}  # fmt: skip
    over = [*FAST, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_cli([*cmd, *over], cwd=tmp_path, env=fresh)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (r.stdout + r.stderr).splitlines()  # our lines are all on stdout until the end
    assert lines[0].startswith("stabilize-train: tiny GPT ("), lines
    first_step = next(i for i, x in enumerate(lines) if x.startswith(("step ", "[stability]")))
    (entry,) = [p for p in (tmp_path / "c" / "tokens").iterdir() if p.is_dir()]
    said = [x.split("] - ", 1)[-1] for x in lines[1:first_step]]
    assert len(said) == 3, lines
    assert said[0].startswith(f"token cache {entry.name}: building (")
    assert said[1].startswith(f"token cache {entry.name}: memory-mapped (")
    kernel = f"fused CPU RMSNorm kernel unavailable (C++ compiler ({fresh['CXX']})"
    assert said[2].startswith(kernel), said
    assert not [x for x in lines if "font" in x.lower() or str(entry) in x], lines


BOUNDED = [
    *FAST,
    "logger=none",
    "trainer.max_steps=20",
    "trainer.log_every_n_steps=10",
    "trainer.val_check_interval=100",
    "monitor.loss_spike.enabled=false",
    "fault=nan_loss",
    "fault.step=3",
    "fault.persistent=true",
    "rollback=off",
]


def test_rollback_off_console_summarises_and_says_would_roll_back(tmp_path, capsys):
    out = run(compose_run(tmp_path, BOUNDED))
    assert out["model_step"] == 20
    text = capsys.readouterr().out
    console = [line for line in text.splitlines() if line.startswith("[stability]")]
    evs = [e for e in read_events(tmp_path) if e["kind"] != "info"]
    verdicts = [e for e in evs if e["kind"] == "rollback"]
    assert len(verdicts) >= 15  # NaN from step 3 on: a verdict every step, all in the file
    assert len(console) <= 6, console
    assert "ROLLBACK" not in text and "would roll back (rollback off) step 3:" in text
    # the console's counts add up to the file's: every event printed or counted
    counted = 0
    for line in console:
        m = re.match(r"\[stability\] step \d+(?:-\d+)?: (\d+) ", line)
        counted += int(m.group(1)) - 1 if m else 1  # a summary includes its printed first
    assert counted == len(evs), (console, len(evs))


LADDER = [
    *FAST,
    "logger=none",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=5",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    "rollback.snapshot_every=2",
    "rollback.durable_every=0",
    "monitor.loss_spike.enabled=false",
    "fault=nan_loss",
    "fault.step=7",
    "norm=rmsnorm",
    "model.init_std=0.1",
]


@pytest.mark.parametrize(
    "ladder, changed",
    [
        (
            ["rollback.ladder=[fp32_reduction]", "norm.reduction_dtype=fp16"],
            "norm.reduction_dtype fp16 -> fp32",
        ),
        pytest.param(
            ["rollback.ladder=[lower_lr]", "optim.lr=0.002"],
            "optim.lr x0.5 (0.002 -> 0.001)",
            marks=pytest.mark.slow,  # the same path as the case above; ~5 s
        ),
    ],
)
def test_final_summary_names_each_rollback_and_the_config_it_ended_with(ladder, changed, tmp_path):
    cfg = compose_run(tmp_path, [*LADDER, *ladder])
    out = run(cfg)
    lines = final_summary(cfg, out, read_events(tmp_path))
    raw = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    done = [e for e in raw if e["kind"] == "rollback" and e["monitor"] == "rollback"]
    assert len(done) == 1 and done[0]["step"] == 7
    result = json.loads((tmp_path / "result.json").read_text())
    undone = result["global_step"] - result["model_step"]
    assert lines[0].startswith(
        f"done: 10 steps (10 asked; {undone} more were run and undone by 1 rollback(s))"
    ), lines
    remedy = done[0]["extra"]["remedy"]
    back = done[0]["extra"]["restored_step"]
    assert lines[1].startswith("  rollback 1 at step 7 (nonfinite: "), lines
    assert f"-> back to step {back}, remedy {remedy}" in lines[1]
    # a NaN loss: the gradient came into the head non-finite (grad_scan.py)
    assert lines[2] == (
        "first non-finite gradient, at step 7: none made it: the loss was non-finite, so every "
        "gradient was (the first in backward order, lm_head, came in non-finite); the re-run "
        "of the step was finite"
    )
    assert lines[3] == f"ended with: {changed} (the remedies')"
    assert result["ended_with"]["remedies"] == [remedy]


class _Bar(L.Callback):
    """Reads the Rich bar's train task and its metrics at the end of training."""

    def on_train_end(self, trainer, pl_module):
        bar = trainer.progress_bar_callback
        task = bar.progress.tasks[bar.train_progress_bar_id]
        self.seen = (task.description, task.total, task.completed)
        self.metrics = bar.get_metrics(trainer, pl_module)


def test_the_rich_bar_counts_model_steps_to_the_stop_step(tmp_path):
    grab = _Bar()
    out = run(
        compose_run(tmp_path, [*FAST, "logger=none", "trainer.progress=rich"]),
        callbacks=[grab],
    )
    # Lightning's own bar: "Epoch 0/-2", total unknown ("--"), no ETA
    assert grab.seen == ("train", 4, out["model_step"])
    assert set(grab.metrics) == {"loss", "grad_norm", "lr"}  # fp32: no loss scale; no v_num
    assert float(grab.metrics["loss"]) == pytest.approx(out["metrics"]["train/loss"], rel=1e-3)
