"""Issue 37's optimizer-state site (stabilize/lit/optim_state.py, ``optim.state_dtype``):
AdamW's moments kept at bf16's precision, checked against a float64 AdamW computed by hand,
and the gap bisection counts it as a site of the run."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from stabilize.lit.optim_state import MasterWeights, round_moments_to_bf16
from stabilize.model.config import GPTConfig
from stabilize.replay.gap_bisect import LOSS, MASTER, OPTIM_STATE, run_sites
from stabilize.run.config import OptimConfig, PrecisionConfig, TrainerConfig

B1, B2 = 0.9, 0.95


def _steps(hook: bool, grads: list[torch.Tensor]) -> torch.optim.AdamW:
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(B1, B2), weight_decay=0.0)
    if hook:
        opt.register_step_post_hook(round_moments_to_bf16)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return opt


def test_the_moments_are_bf16_after_each_step_as_a_float64_adam_says():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(512, generator=g) * 10 ** torch.empty(512).uniform_(-4, 1, generator=g)
             for _ in range(3)]  # fmt: skip
    st = next(iter(_steps(True, grads).state.values()))
    plain = next(iter(_steps(False, grads).state.values()))
    # by hand in float64, each moment rounded to bf16 after its step
    m = v = torch.zeros(512, dtype=torch.float64)
    for x in grads:
        x = x.double()
        m = (B1 * m + (1 - B1) * x).bfloat16().double()
        v = (B2 * v + (1 - B2) * x * x).bfloat16().double()
    for got, want in ((st["exp_avg"], m), (st["exp_avg_sq"], v)):
        assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())
        # within one bf16 spacing (2^-8 relative) of the float64 reference: fp32's own
        # arithmetic may round the other way at a tie
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-30).all()
    assert not torch.equal(st["exp_avg_sq"], plain["exp_avg_sq"])  # the knob does something


def _cfg(precision="bf16-mixed", loss="fp32", strategy="auto", **optim):
    return SimpleNamespace(model=GPTConfig(loss_dtype=loss), optim=OptimConfig(**optim),
                           precision=PrecisionConfig(name=precision),
                           trainer=TrainerConfig(strategy=strategy))  # fmt: skip


def test_the_bisection_counts_a_run_site_only_where_it_is_not_fp32():
    assert run_sites(_cfg(state_dtype="bf16")) == [OPTIM_STATE]
    assert run_sites(_cfg()) == []
    # pure bf16: bf16 weights with no master copy (AdamW's moments bf16 with them), the loss
    # in the logits' dtype; an fp32 master is not a site
    assert run_sites(_cfg("bf16-true", "logits")) == [LOSS, MASTER]
    assert run_sites(_cfg("bf16-true", master_dtype="fp32")) == []
    assert run_sites(_cfg(master_dtype="fp32", state_dtype="bf16")) == [OPTIM_STATE]
    assert run_sites(_cfg("bf16-true", strategy="fsdp")) == []  # no fp32 masters under FSDP


def test_an_fp32_master_keeps_the_updates_a_pure_bf16_weight_loses():
    """A constant gradient makes every Adam update lr / (1 + eps) (m_hat / sqrt(v_hat) = 1):
    1e-3, under half of bf16's spacing below 1.0 (2^-9), so a bf16 weight at 1.0 never
    moves; the fp32 master follows the float64 sum by hand and the bf16 weight is that
    master rounded."""
    lr, n = 1e-3, 12
    runs = {}
    for master in (False, True):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([w], lr=lr, betas=(B1, B2), weight_decay=0.0, eps=1e-8)
        mw = MasterWeights(opt, torch.nn.ParameterList([w])) if master else None
        for _ in range(n):
            w.grad = torch.ones(4, dtype=torch.bfloat16)
            if mw is not None:
                mw.before_step()  # Lightning's on_before_optimizer_step
            opt.step()
        runs[master] = (w.detach().clone(), mw)
    assert torch.equal(runs[False][0], torch.ones(4, dtype=torch.bfloat16))  # lost, every step
    w, mw = runs[True]
    (m,) = mw.state_dict().values()
    want = 1.0 - n * lr / (1.0 + 1e-8)  # float64, by hand
    assert m.dtype == torch.float32 and (m.double() - want).abs().max() < 1e-6
    assert w.dtype == torch.bfloat16 and torch.equal(w, m.bfloat16())
    assert float(w[0]) < 1.0  # the 12 lost updates, kept: the weight moved
    state = next(iter(mw.opt.state.values()))
    assert state["exp_avg"].dtype == torch.float32  # the moments live with the master


def test_bf16_true_with_an_fp32_master_trains_and_resumes_exactly(tmp_path):
    """A Lightning run under bf16-true with optim.master_dtype=fp32: the masters travel in
    the checkpoint, so a run stopped at step 4 and resumed ends on the uninterrupted run's
    weights and masters, bit for bit; the masters hold what bf16 weights cannot."""
    from stabilize.lit.runner import run

    from conftest import FAST, compose_run

    common = [*FAST, "trainer.max_steps=8", "precision=bf16-true", "optim.master_dtype=fp32",
              "optim.lr=1e-3"]  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(compose_run(full, common))
    run(compose_run(cut, [*common, "trainer.stop_at_step=4"]))
    run(compose_run(cut, [*common, "resume=auto"]))
    a = torch.load(full / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(cut / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["stabilize"]["model_step"] == b["stabilize"]["model_step"] == 8
    for k, v in a["state_dict"].items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, b["state_dict"][k]), k
    masters = a["master_weights"]
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    moved = 0
    for name, m in masters.items():
        assert torch.equal(m, b["master_weights"][name]), name
        p = a["state_dict"][f"model.{name}"]
        assert torch.equal(m.bfloat16(), p), name  # each weight is its master, rounded
        moved += int((m != p.float()).sum())
    assert moved > 0  # the masters carry what the bf16 weights round away
    for ckpt in (a, b):  # the resumed run's moments were not cast to bf16 on the way in
        opt_state = ckpt["optimizer_states"][0]["state"]
        assert all(s["exp_avg_sq"].dtype == torch.float32 for s in opt_state.values())
    for s, t in zip(a["optimizer_states"][0]["state"].values(),
                    b["optimizer_states"][0]["state"].values(), strict=True):  # fmt: skip
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])


def test_a_rollback_restore_takes_the_masters_from_the_restored_weights():
    """The harness restores a snapshot as weights, then optimizer state (controller.py):
    the masters of the discarded steps must go with them. 2 steps, a snapshot, 3 more
    steps, the restore: each master is its restored weight (the snapshot holds no master),
    not the later master that still rounds to it."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(B1, B2), weight_decay=0.0)
    mw = MasterWeights(opt, torch.nn.ParameterList([w]))

    def step():
        w.grad = torch.ones(4, dtype=torch.bfloat16)
        mw.before_step()
        opt.step()

    for _ in range(2):
        step()
    snap = {"w": w.detach().clone(), "opt": copy.deepcopy(opt.state_dict())}
    for _ in range(3):
        step()
    (later,) = mw.state_dict().values()
    assert torch.equal(later.bfloat16(), snap["w"]) and float(later[0]) < 1 - 4e-3
    with torch.no_grad():
        w.copy_(snap["w"])  # the restore: weights first, then the optimizer
    opt.load_state_dict(snap["opt"])
    (m,) = mw.state_dict().values()
    assert torch.equal(m, snap["w"].float())  # not the discarded steps' master
    assert next(iter(opt.state.values()))["exp_avg"].dtype == torch.float32
