"""``stabilize-train quant=...`` (configs/quant/, stabilize/quant/config.py): our GPT's
Linears (the head excepted) train with quantized GEMMs, the description line says so, and
every quantized operand's headroom series is in the run's metrics; delayed scaling's
history is in the checkpoint (a resume and a rollback carry it). The bad inputs are in
tests/test_errors.py's one-line cases."""

from __future__ import annotations

import math

import pytest
import torch

from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics

LINEARS = ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj",
           "h.1.attn.c_attn", "h.1.attn.c_proj", "h.1.mlp.c_fc", "h.1.mlp.c_proj"]  # fmt: skip


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8", "nvfp4", "fp8_tensor"])
def test_a_quantized_run_trains_and_logs_every_operands_headroom(recipe, tmp_path, capsys):
    if recipe == "fp8_tensor":
        pytest.importorskip("torchao")
    out = run(compose_run(tmp_path, [*FAST, f"quant={recipe}", "trainer.max_steps=3"]))
    assert out["model_step"] == 3 and math.isfinite(out["metrics"]["train/loss"])
    said = capsys.readouterr().out
    assert f"GEMMs in {recipe} (8 of 9 Linears)" in said.splitlines()[0]  # the head stays
    rows = read_csv_metrics(tmp_path)
    keys = {k for r in rows for k in r if k.startswith("q_sqnr/")}
    assert keys == {f"q_sqnr/{n}.{op}" for n in LINEARS for op in ("x", "w", "dy")}
    last = [r for r in rows if "q_sqnr/h.0.mlp.c_fc.x" in r][-1]
    # fewer bits, less signal: an 8-bit activation well above a 4-bit one
    floor = 10 if recipe == "nvfp4" else 25
    assert all(last[f"q_sqnr/{n}.x"] > floor for n in LINEARS), last
    if recipe == "fp8_delayed":
        ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
        hist = ckpt["state_dict"]["model.h.0.mlp.c_fc.amax_history"]
        assert hist.shape == (3, 1024) and (hist[0, -3:] > 0).all()  # 3 steps recorded
