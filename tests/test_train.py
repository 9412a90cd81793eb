"""The training loop end to end: a real Lightning Trainer, real Hydra composition, real W&B
offline files, on CPU with the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from stabilize.lit.module import lr_factor, param_groups
from stabilize.model import GPT, GPTConfig
from stabilize.norms import NORM_TYPES
from stabilize.run.config import PRECISIONS, OptimConfig
from stabilize.train import run
from stabilize.wandb_offline import find_offline_runs, read_offline_run

from conftest import CONFIGS, FAST, cli, compose_run, read_csv_metrics, series

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


# Full-scale recipes train here at tiny scale: the same groups and settings, a smaller model;
# a drift fault starts inside the shortened run (one that could never fire is refused) and
# keeps its planned crossing step, far beyond it.
AT_TINY_SCALE = {
    "nan_at_12000": ["model=tiny", "fault.layer=1", "fault.step=3"],
    "nan_repro": ["fault.step=3"],
    "formats": ["fault.step=2"],
}


# nan_at_12000 (~15 s) also trains shrunk in tests/test_recipe.py, with its accumulation
@pytest.mark.parametrize(
    "experiment",
    [pytest.param(e, marks=pytest.mark.slow) if e == "nan_at_12000" else e for e in EXPERIMENTS],
)
def test_every_experiment_composes_and_trains(experiment, tmp_path):
    extra = AT_TINY_SCALE.get(experiment, [])
    cfg = compose_run(tmp_path, [f"experiment={experiment}", *FAST, "logger=none", *extra])
    out = run(cfg)
    assert out["global_step"] == 4 and out["model_step"] == 4
    assert math.isfinite(out["metrics"]["train/loss"])
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


class ActivationDtype(L.Callback):
    """Records the dtype the first MLP's input projection really produced."""

    def __init__(self):
        self.dtypes = set()

    def on_fit_start(self, trainer, pl_module):
        pl_module.model.h[0].mlp.c_fc.register_forward_hook(
            lambda m, i, o: self.dtypes.add(o.dtype)
        )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_trains_in_its_real_dtype(precision, tmp_path):
    cfg = compose_run(tmp_path, [f"precision={precision}", *FAST, "logger=none"])
    probe = ActivationDtype()
    out = run(cfg, callbacks=[probe])
    want = {
        "fp32": torch.float32,
        "fp16-mixed": torch.float16,
        "bf16-mixed": torch.bfloat16,
        "bf16-true": torch.bfloat16,
    }[precision]
    # fp16 must be REAL fp16 on CPU, not Lightning's silent bf16 downgrade
    assert probe.dtypes == {want}
    assert math.isfinite(out["metrics"]["train/loss"])
    scale = series(read_csv_metrics(tmp_path), "train/loss_scale")
    if precision == "fp16-mixed":
        assert scale and all(v > 0 for v in scale.values())
    else:
        assert not scale


def test_loss_falls_on_the_embedded_corpus(tmp_path):
    cfg = compose_run(
        tmp_path,
        [
            *FAST,
            "trainer.max_steps=60",
            "trainer.val_check_interval=20",
            "logger=none",
            "optim.lr=3e-3",
            "optim.warmup_steps=5",
            "data.batch_size=16",
            "trainer.limit_val_batches=4",
        ],
    )
    run(cfg)
    rows = read_csv_metrics(tmp_path)
    loss = series(rows, "train/loss")
    val = list(series(rows, "val/loss").values())
    assert loss[0] > 5.0  # ~ln 256 = 5.55 at init
    assert sum(list(loss.values())[-5:]) / 5 < 3.6  # from 5.55: the byte statistics learnt
    assert len(val) == 3 and val[2] < val[0] < 5.0
    bpb = list(series(rows, "val/bpb").values())
    assert bpb[2] == pytest.approx(val[2] / math.log(2), rel=1e-5)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """fp32 on CPU: the loss at every step after resume equals the uninterrupted run's."""
    common = [
        *FAST,
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_check_interval=5",
        "model.dropout=0.1",
        "logger=none",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(compose_run(full, common))
    first = run(compose_run(cut, [*common, "trainer.stop_at_step=8"]))
    assert first["global_step"] == 8
    second = run(compose_run(cut, [*common, "resume=auto"]))
    assert second["resumed_from"].endswith("last.ckpt")
    assert second["global_step"] == 12 and second["model_step"] == 12

    a, b = series(read_csv_metrics(full), "train/loss"), series(read_csv_metrics(cut), "train/loss")
    assert sorted(b) == list(range(12))  # nothing lost: both launches' logs are kept
    for step in range(8, 12):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    sa = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    sb = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=0)


def test_wandb_offline_run_has_group_tags_config_and_history(tmp_path):
    cfg = compose_run(
        tmp_path,
        [*FAST, "experiment=rmsnorm_fp16", "logger=wandb", "logger.tags=[a,b]", "norm.eps=1e-3",
         "logger.layer_panels=2"],
    )  # fmt: skip
    run(cfg)
    runs = find_offline_runs(tmp_path / "wandb")
    assert len(runs) == 1  # one run per launch
    r = read_offline_run(runs[0], wait_s=30)
    assert r.finished  # the file ends with W&B's exit record: nothing is cut off
    assert r.group == "rmsnorm_fp16" and r.job_type == "train"
    assert r.tags == ["a", "b"]
    assert r.config["norm"]["type"] == "rmsnorm" and r.config["norm"]["eps"] == 1e-3
    assert r.config["norm"]["reduction_dtype"] == "fp16"
    assert r.config["precision"]["name"] == "fp16-mixed"
    losses = r.series("train/loss")
    steps = r.series("train/step")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert steps == sorted(steps) and steps[-1] == 4
    assert r.series("train/loss_scale")
    csv_loss = list(series(read_csv_metrics(tmp_path), "train/loss").values())
    assert losses == pytest.approx(csv_loss)
    # logger.layer_panels=2 reaches the run: act/ (2 blocks, their norms) is one chart
    hidden = [m for m in r.metrics if m["name"] == "act/*" and m["hidden"]]
    assert hidden and hidden[-1]["glob"] and hidden[-1]["summary"] == ["max"]  # peak kept
    assert any("layers/act_table/path" in row for row in r.history)


def test_logger_none_writes_csv_but_no_wandb(tmp_path):
    run(compose_run(tmp_path, [*FAST, "logger=none"]))
    assert not (tmp_path / "wandb").exists()
    assert series(read_csv_metrics(tmp_path), "train/loss")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["logger"]["wandb"] is False and saved["model"]["name"] == "tiny"


def test_local_files_train(tmp_path):
    text = Path(__file__).read_text() * 3
    (tmp_path / "a.txt").write_text(text)
    cfg = compose_run(
        tmp_path / "run", [*FAST, "logger=none", "data=local", f"data.paths=[{tmp_path / 'a.txt'}]"]
    )
    assert math.isfinite(run(cfg)["metrics"]["train/loss"])


# ---- configuration errors ---------------------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_layer=0", "model.n_layer=0 is not allowed; must be a positive integer"),
        ("norm.reduction_dtype=fp8", "norm.reduction_dtype='fp8' is not allowed; allowed: ["),
        ("precision.name=fp8", "precision.name='fp8' is not allowed; allowed: ['fp32'"),
        ("+norm.typo=1", "norm.typo is not a known setting; allowed: ['type'"),
        ("optim.schedule=step", "optim.schedule='step' is not allowed; allowed: ['cosine'"),
    ],
)
def test_bad_values_fail_naming_key_value_and_allowed(override, message, tmp_path):
    with pytest.raises(ValueError) as e:
        compose_run(tmp_path, [override])
    assert message in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs CUDA")
def test_fsdp_trains_on_gpu(tmp_path):  # pragma: no cover - GPU only
    out = run(
        compose_run(
            tmp_path, [*FAST, "trainer.strategy=fsdp", "logger=none", "precision=bf16-mixed"]
        )
    )
    assert math.isfinite(out["metrics"]["train/loss"])


def test_cli_rejects_bad_config_before_training(tmp_path, monkeypatch, capsys):
    code, err = cli(
        ["norm.type=groupnorm", f"hydra.run.dir={tmp_path}"], tmp_path, monkeypatch, capsys
    )
    assert code != 0
    assert f"norm.type='groupnorm' is not allowed; allowed: {list(NORM_TYPES)}" in err
    assert not (tmp_path / "checkpoints").exists()
    code, err = cli(["norm=groupnorm", f"hydra.run.dir={tmp_path}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Available options in 'norm'" in err
    code, err = cli(["model.typo=3", f"hydra.run.dir={tmp_path}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "typo" in err


# ---- optimizer pieces against hand-computed values -----------------------------------------
def test_lr_schedule_warmup_then_cosine_to_floor():
    o = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, o, 110) == pytest.approx(0.1)
    assert lr_factor(9, o, 110) == pytest.approx(1.0)
    assert lr_factor(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos = 0
    assert lr_factor(110, o, 110) == pytest.approx(0.1)
    assert lr_factor(500, o, 110) == pytest.approx(0.1)
    lin = OptimConfig(warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(25, lin, 100) == pytest.approx(0.75)


def test_weight_decay_only_on_matrices():
    m = GPT(GPTConfig(norm={"backend": "explicit", "qk_norm": True}))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    d = {names[id(p)] for p in decay["params"]}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith("weight") and ("c_" in n) for n in d)
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "h.0.attn.q_norm.weight"} <= nd
    assert all(
        n.endswith("bias")
        for n in nd
        if "ln" not in n and "norm" not in n and not n.startswith("w")
    )
    assert len(d) + len(nd) == len(list(m.parameters()))
