"""The end-of-run score on the whole held-out split, checked against a
float64 forward of the saved weights over every held-out block, cut by hand."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from stabilize.data.cache import open_token_cache
from stabilize.model import GPT
from stabilize.report.summary import LAST_STEPS, last_steps_mean
from stabilize.run.config import RunConfig
from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics


def reference_score(cfg: RunConfig, state_dict: dict) -> tuple[float, int]:
    """Mean nats per token over all held-out blocks, in float64, and the token count."""
    stream = open_token_cache(cfg.data).train.long()
    n_val = int(len(stream) * cfg.data.val_fraction)
    val = stream[len(stream) - n_val :]
    t = cfg.model.block_size
    model = GPT(cfg.model).double()
    model.load_state_dict({k.removeprefix("model."): v for k, v in state_dict.items()})
    model.eval()
    nats, tokens = 0.0, 0
    with torch.no_grad():
        for i in range((len(val) - 1) // t):
            x, y = val[i * t : i * t + t][None], val[i * t + 1 : i * t + t + 1][None]
            nats += F.cross_entropy(model(x)[0].double(), y[0], reduction="sum").item()
            tokens += t
    return nats / tokens, tokens


def test_final_eval_scores_every_held_out_block_as_float64_does(tmp_path):
    # the whole held-out split (FAST bounds it to 2 batches)
    over = [*FAST, "trainer.final_eval_batches=null", "precision=fp32", "rollback=off"]
    cfg = compose_run(tmp_path, over)
    out = run(cfg)
    score = json.loads((tmp_path / "final_eval.json").read_text())
    sd = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    loss, tokens = reference_score(cfg, sd)
    assert score["tokens"] == tokens == score["bytes"]  # bytes: one byte per token
    assert score["batches"] == math.ceil(score["held_out_blocks"] / cfg.data.batch_size)
    assert abs(score["loss"] - loss) <= 1e-5 * loss
    assert abs(score["bpb"] - loss / math.log(2)) <= 1e-5 * loss
    assert out["metrics"]["final/val_bpb"] == score["bpb"]
    # the periodic validation read 2 batches: not the same number
    rows = read_csv_metrics(tmp_path)
    assert [r["final/val_bpb"] for r in rows if "final/val_bpb" in r] == [score["bpb"]]


def test_final_eval_off_and_bounded(tmp_path, monkeypatch, capsys):
    run(compose_run(tmp_path / "off", [*FAST, "logger=none", "trainer.final_eval_batches=0"]))
    assert not (tmp_path / "off" / "final_eval.json").exists()
    # nothing held out: no score (not a NaN one), and the run ends as usual
    out = run(compose_run(tmp_path / "none", [*FAST, "logger=none", "data.val_fraction=0"]))
    assert not (tmp_path / "none" / "final_eval.json").exists()
    assert "final/val_bpb" not in out["metrics"] and out["model_step"] == 4
    run(compose_run(tmp_path / "two", [*FAST, "logger=none", "trainer.final_eval_batches=2"]))
    score = json.loads((tmp_path / "two" / "final_eval.json").read_text())
    assert score["batches"] == 2 and score["tokens"] == 2 * 4 * 64  # batch 4, block 64
    # the token bound (trainer.final_eval_tokens): whole batches up to it, 3 x 256 tokens;
    # and its progress line, here after every batch (every 10 s in a real run)
    monkeypatch.setattr("stabilize.lit.final_eval.PROGRESS_EVERY_S", 0.0)
    capsys.readouterr()
    tok = ["trainer.final_eval_batches=null", "trainer.final_eval_tokens=1000"]
    run(compose_run(tmp_path / "tok", [*FAST, *tok]))
    score = json.loads((tmp_path / "tok" / "final_eval.json").read_text())
    assert score["batches"] == 3 and score["tokens"] == 3 * 4 * 64 and not score["whole"]
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("final eval: ")]
    assert [x.split()[2] for x in said] == ["1/3", "2/3"], said


def test_final_loss_is_the_mean_of_the_last_steps_with_replays_counted_once():
    # steps 1..30; a rollback replays 28-30 with other losses: their last values count
    losses = [(float(s), float(s)) for s in range(1, 31)] + [(28.0, 1.0), (29.0, 2.0), (30.0, 3.0)]
    window = [float(s) for s in range(31 - LAST_STEPS, 28)] + [1.0, 2.0, 3.0]
    assert last_steps_mean(losses) == sum(window) / LAST_STEPS
    assert math.isnan(last_steps_mean([*losses, (30.0, float("nan"))]))
