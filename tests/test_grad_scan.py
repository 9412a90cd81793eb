"""Live localization of a non-finite gradient from the failing step's own gradients
(stabilize/stability/grad_scan.py): a transient fault does not recur in a replay, so
only the step itself can name where it started. Real Lightning runs on CPU; the reference
is the parameter the fault was planted on."""

from __future__ import annotations

import math

import torch
from torch import nn

from stabilize.model import GPT, GPTConfig
from stabilize.run.summary import final_summary, read_events
from stabilize.stability.grad_scan import backward_order, scan
from stabilize.train import run
from tests.conftest import FAST, compose_run, read_csv_metrics, series

FAULT = ["fault=inf_grad", "fault.param=h.1.mlp.c_fc.weight", "fault.step=4"]
BASE = [*FAST, "trainer.max_steps=6", "trainer.val_check_interval=100", "logger=none"]


def test_backward_order_starts_at_the_head_and_gives_a_tied_weight_to_it_named_with_wte():
    model = GPT(GPTConfig.preset("tiny"))
    order = [name for name, _ in backward_order(model)]
    # the tied weight is the head's (first in backward order); the embeddings come last
    assert order[0] == "lm_head" and order[-1] == "wpe" and "wte" not in order
    assert order.index("h.1.mlp.c_proj") < order.index("h.1.mlp.c_fc") < order.index("h.0.ln_1")
    owned = [id(p) for _, ps in backward_order(model) for p in ps]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each one, once
    # a non-finite embedding gradient shows in the tied weight: the scan names both owners
    # and claims no origin (issue 34: it said "lm_head made it" where h.0.ln_1 did)
    model(torch.randint(0, 256, (2, 8))).float().sum().backward()
    model.wte.weight.grad[3, 0] = math.nan
    got = scan(model)
    assert (got["grad_module"], got["shared_with"], got["grad_incoming_finite"]) == (
        "lm_head", ["wte"], None,
    )  # fmt: skip


def test_scan_names_the_planted_module_and_infers_its_incoming_gradient_by_hand():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    net(torch.randn(3, 4)).sum().backward()
    assert scan(net)["grad_module"] is None
    net[1].weight.grad[0, 0] = math.inf  # the middle layer made it: the head is finite
    got = scan(net)
    assert (got["grad_module"], got["grad_incoming_finite"], got["nonfinite_modules"]) == (
        "1", True, 1,
    )  # fmt: skip
    net[2].bias.grad[0] = math.nan  # now the head too, under a NaN loss: it came in so
    got = scan(net, loss_finite=False)
    assert (got["grad_module"], got["grad_incoming_finite"]) == ("2", False)
    assert not math.isfinite(got["block_grad_norm"]["other"])


def _check(tmp_path, precision: str, capsys):
    out = run(compose_run(tmp_path, [*BASE, *FAULT, f"precision={precision}"]))
    console = capsys.readouterr().out
    evs = read_events(tmp_path)
    hit = [e for e in evs if (e.get("extra") or {}).get("grad_scan")]
    assert hit and hit[0]["step"] == 4, [(e["monitor"], e["step"]) for e in evs]
    scan_ = hit[0]["extra"]["grad_scan"]
    assert scan_["grad_module"] == "h.1.mlp.c_fc" and scan_["grad_incoming_finite"] is True
    # the transient fault does not recur in the step's re-run: the scan's name, said so
    assert scan_["rerun"] == "finite" and scan_["found_by"] == "scan"
    assert (
        "first non-finite gradient: h.1.mlp.c_fc (backward order, from the step's gradients; "
        "its incoming gradient was finite: it made the non-finite value); the re-run of the "
        "step was finite"
    ) in console
    # the step's per-block gradient norms are logged, the non-finite one kept
    h1 = series(read_csv_metrics(tmp_path), "grad_norm/h.1")
    assert any(math.isinf(v) for v in h1.values()), h1
    summary = final_summary(compose_run(tmp_path, BASE), out, evs)
    assert "first non-finite gradient, at step 4: h.1.mlp.c_fc (backward order" in "\n".join(
        summary
    )
    return hit[0]


def test_a_transient_inf_gradient_is_named_live_in_fp32(tmp_path, capsys):
    e = _check(tmp_path, "fp32", capsys)
    assert e["monitor"] == "nonfinite"


def test_a_transient_inf_gradient_is_named_live_in_fp16(tmp_path, capsys):
    e = _check(tmp_path, "fp16-mixed", capsys)
    assert e["monitor"] in ("nonfinite", "loss_scale")
