"""Issue 38's optimizer-state series (stabilize/stability/curvature.py, param_stats.py
``adamw_terms``): the curvature along a direction on a quadratic with a known Hessian
(float64, by hand), the difference quotient against an exact double backward on the tiny
GPT, AdamW's g^2 / v_hat and preconditioner against a float64 AdamW by hand, and a real
Lightning run that logs the series on log steps at two extra forward and backward passes
per curvature step without changing the run."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from stabilize.stability.curvature import (
    double_backward_hvp,
    hvp_difference,
    quotients,
    stability_lines,
)
from stabilize.stability.param_stats import adamw_terms

from conftest import FAST, compose_run, read_csv_metrics


def test_on_a_quadratic_the_quotients_are_the_analytic_ones_to_float64_precision():
    """L = 1/2 x^T A x + b^T x: H = A everywhere, so u^T H u / ||u||^2 and u^T H u / u^T P u
    are known exactly; the difference of gradients gives them to ~1e-10, and the weights
    come back bit for bit."""
    g = torch.Generator().manual_seed(0)
    n = 40
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    eig = torch.logspace(-2, 2, n, dtype=torch.float64)  # condition number 1e4
    a = q @ torch.diag(eig) @ q.T
    b = torch.randn(n, dtype=torch.float64, generator=g)
    x = torch.nn.Parameter(torch.randn(n, dtype=torch.float64, generator=g))
    before = x.detach().clone()

    def grad():
        (gx,) = torch.autograd.grad(0.5 * x @ a @ x + b @ x, [x])
        return [gx]

    u = torch.randn(n, dtype=torch.float64, generator=g)
    p = torch.rand(n, dtype=torch.float64, generator=g) + 0.1
    hu, h = hvp_difference([x], [u], grad)
    assert h > 0 and torch.equal(x.detach(), before)
    curv_u, curv_pre = quotients([u], hu, [p])
    want_u = float(u @ a @ u / (u @ u))  # by hand
    want_pre = float(u @ a @ u / (u @ (p * u)))
    assert abs(curv_u / want_u - 1) < 1e-9 and abs(curv_pre / want_pre - 1) < 1e-9
    # along an eigenvector the quotient is its eigenvalue, and the largest one bounds it
    hu, _ = hvp_difference([x], [q[:, -1]], grad)
    assert abs(quotients([q[:, -1]], hu, [torch.ones(n)])[0] / 100.0 - 1) < 1e-9


def test_adamw_terms_match_a_float64_adamw_by_hand():
    """The change AdamW makes (checked against torch's AdamW itself), its preconditioner P
    (change = lr P^-1 m + lr wd p) and g^2 / v_hat, whose bound is (1 - b2^t) / (1 - b2)."""
    b1, b2, lr, wd, eps = 0.9, 0.95, 1e-2, 0.1, 1e-8
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, generator=gen))
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), weight_decay=wd, eps=eps)
    grads = [torch.randn(64, generator=gen) * 0.01 for _ in range(5)]
    grads[-1][:8] = 10.0  # a gradient that surprises its decayed v_hat
    m = v = torch.zeros(64, dtype=torch.float64)
    for t, gr in enumerate(grads, start=1):
        group, state = opt.param_groups[0], opt.state.get(p, {})
        change, pdiag, ratio = adamw_terms(p.detach(), gr, state, group)
        gd = gr.double()
        m, v = b1 * m + (1 - b1) * gd, b2 * v + (1 - b2) * gd * gd
        vhat = v / (1 - b2**t)
        want_p = (1 - b1**t) * (vhat.sqrt() + eps)
        torch.testing.assert_close(pdiag.double(), want_p, rtol=1e-5, atol=0)
        torch.testing.assert_close(ratio.double(), gd * gd / vhat, rtol=1e-4, atol=0)
        assert float(ratio.max()) <= (1 - b2**t) / (1 - b2) * (1 + 1e-5)
        before = p.detach().clone()
        p.grad = gr.clone()
        opt.step()
        # torch's own step: within fp32's spacing of weights near 1 (the difference rounds)
        torch.testing.assert_close(before - p.detach(), change, rtol=1e-4, atol=2.5e-7)
        torch.testing.assert_close(
            change.double(), lr * m / want_p + lr * wd * before.double(), rtol=1e-4, atol=1e-9
        )
    # the surprise: at the bound (1 - b2^5) / (1 - b2) = 4.52, where the others average ~1
    assert float(ratio[:8].min()) > 0.999 * (1 - b2**5) / (1 - b2) > 4
    assert 0.5 < float(ratio[8:].mean()) < 1.5


def test_the_lines_are_two_over_lr_and_adams_38_over_lr():
    gd, adam = stability_lines(1e-3, 0.9)
    assert gd == pytest.approx(2000.0) and adam == pytest.approx(38000.0)


class _Forwards(L.Callback):
    """Counts the model's training forwards (the step's and the curvature's)."""

    def __init__(self):
        self.n = 0
        self.precision: list[str] = []  # torch's fp32 matmul precision at each forward

    def on_fit_start(self, trainer, pl_module):
        def hook(module, args, out):
            if module.training:
                self.n += 1
                self.precision.append(torch.get_float32_matmul_precision())

        pl_module.model.register_forward_hook(hook)


def test_a_run_logs_the_series_on_log_steps_at_two_extra_passes_and_the_same_losses(tmp_path):
    """8 steps, a log step every 2, the curvature on every log step: g2_v and update ratios
    per block and whole, curv_u / curv_pre beside their lines on the 4 log steps and on no
    other; 8 + 2 x 4 training forwards, the pass's in full fp32 under a run that allows
    TF32; the losses are those of the run without it (the default: off), bit for bit (the
    pass restores the weights and leaves every .grad alone)."""
    from stabilize.lit.runner import run

    common = [*FAST, "trainer.max_steps=8", "trainer.log_every_n_steps=2", "model.dropout=0.1"]
    counted = _Forwards()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32, as a user on an A100 may set it
    try:
        run(compose_run(tmp_path / "on", [*common, "monitor.curvature.every=1"]), [counted])
        assert torch.get_float32_matmul_precision() == "high"  # restored after each pass
    finally:
        torch.set_float32_matmul_precision(before)
    # the two passes in full fp32, the step's own forwards as the user set them
    assert counted.precision.count("highest") == 8 and counted.precision.count("high") == 8
    run(compose_run(tmp_path / "off", common))  # the default: monitor.curvature.every=0
    rows = {tag: read_csv_metrics(tmp_path / tag) for tag in ("on", "off")}
    losses = {tag: [r["train/loss"] for r in rs if "train/loss" in r] for tag, rs in rows.items()}
    assert len(losses["on"]) >= 4 and losses["on"] == losses["off"]
    curv = [r for r in rows["on"] if "opt/curv_pre" in r]
    assert len(curv) == 4 and counted.n == 8 + 2 * 4
    for r in curv:
        assert math.isfinite(r["opt/curv_u"]) and r["opt/edge_adam"] == pytest.approx(
            19 * r["opt/edge_gd"]
        )
        assert r["opt/update_ratio"] > 0 and r["opt/g2_v"] > 0 and r["g2_v/h.0"] > 0
    assert not any("opt/curv_pre" in r for r in rows["off"])
    assert any("opt/g2_v" in r for r in rows["off"])  # g^2 / v_hat: every log step


def test_the_hvp_check_script_writes_its_table_and_the_central_difference_holds(tmp_path):
    """docs/design-spikes.md's command as written, into a copy of the doc: on the tiny GPT
    (the flash kernel, as a run takes it), at the chosen step (rel 1e-4) the central
    difference is within 1% of the exact double backward (the math kernel) along every
    direction, AdamW's (the sign of the gradient) included, and the forward difference is
    the worse of the two along AdamW's."""
    from doc_commands import doc_command

    from conftest import ROOT, run_cli

    doc = tmp_path / "design-spikes.md"
    doc.write_text((ROOT / "docs" / "design-spikes.md").read_text())
    cmd = doc_command("hvp-check").replace("python", "$PYTHON", 1) + f" --doc {doc}"
    r = run_cli(["bash", "-c", cmd], cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = doc.read_text()
    block = text[text.index("<!-- hvp-check:begin -->") : text.index("<!-- hvp-check:end -->")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()
            if line.startswith("| ") and "%" in line]  # fmt: skip
    assert len(rows) == 9
    pct = {(d, rel): (float(f[:-1]), float(c[:-1])) for d, rel, f, c in rows}
    for d in ("sign(g) (AdamW-like)", "g", "random"):
        assert abs(pct[d, "0.0001"][1]) < 1.0, (d, pct[d, "0.0001"])
    fwd, cen = pct["sign(g) (AdamW-like)", "0.0001"]
    assert abs(fwd) > abs(cen)


def test_past_its_edge_a_small_model_starts_to_oscillate_at_adams_line_not_at_2_over_lr():
    """Full-batch AdamW (lr 1e-2, beta1 0.9, beta2 0.999) on a small tanh MLP in float64
    trains past its edge of stability. At the onset of oscillation (the first of three
    loss rises in a row after step 20) the preconditioned sharpness lambda_max(P^-1 H), by
    power iteration on exact double-backward products, sits at Adam's line 38/lr (measured
    1.04 x), about 20 x gradient descent's 2/lr. The harness's own quotient along the
    update, curv_pre, never exceeds it (a Rayleigh quotient of the same pencil) and rises
    toward it as the oscillation aligns the update with the sharp direction (measured: 0.50
    at the onset, 0.86 at its peak)."""
    torch.manual_seed(0)
    f64 = torch.float64
    x, w = torch.randn(256, 16, dtype=f64), torch.randn(16, 1, dtype=f64)
    y = torch.sin(x @ w)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                              torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(f64)  # fmt: skip
    ps = list(net.parameters())
    lr = 1e-2
    opt = torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def loss():
        return 0.5 * ((net(x) - y) ** 2).mean()

    def grad():
        return list(torch.autograd.grad(loss(), ps))

    def sharpness(pdiag, iters=50):  # lambda_max of P^-1/2 H P^-1/2, by power iteration
        v = [torch.randn_like(p) for p in ps]
        lam = 0.0
        for _ in range(iters):
            norm = math.sqrt(sum(float((a * a).sum()) for a in v))
            v = [a / norm for a in v]
            hv = double_backward_hvp(
                loss, ps, [a / q.sqrt() for a, q in zip(v, pdiag, strict=True)]
            )
            nv = [h / q.sqrt() for h, q in zip(hv, pdiag, strict=True)]
            lam = sum(float((a * b).sum()) for a, b in zip(v, nv, strict=True))
            v = nv
        return lam

    edge_gd, edge_adam = stability_lines(lr, 0.9)
    losses, onset, seen = [], None, []
    for t in range(1, 141):
        opt.zero_grad()
        value = loss()
        value.backward()
        losses.append(float(value))
        terms = [adamw_terms(p.detach(), p.grad, opt.state.get(p, {}), opt.param_groups[0])
                 for p in ps]  # fmt: skip
        u, pdiag = [c for c, _, _ in terms], [q for _, q, _ in terms]
        _, curv_pre = quotients(u, hvp_difference(ps, u, grad)[0], pdiag)
        if onset is None and t > 20 and losses[-1] > losses[-2] > losses[-3] > losses[-4]:
            onset = t
        if onset is not None and t <= onset + 5:
            lam = sharpness(pdiag)
            assert curv_pre <= lam * (1 + 1e-3), (t, curv_pre, lam)
            seen.append((t, lam, curv_pre))
        opt.step()
    assert onset is not None, "no oscillation within 140 steps"
    _, lam, at_onset = seen[0]
    assert 0.9 < lam / edge_adam < 1.15 and lam / edge_gd > 15  # Adam's line, not 2/lr
    assert max(c for _, _, c in seen) > max(0.6 * edge_adam, at_onset)


def test_on_a_hugging_face_gpt2_the_series_reach_wandb_and_csv(tmp_path):
    """A user's own LightningModule (Hugging Face GPT-2, tests/your_lm.py) with the public
    callback: the curvature and g^2 / v_hat series are in the real offline W&B run and in
    the CSV, with the same values at the same steps."""
    pytest.importorskip("transformers")
    from lightning.pytorch.loggers import CSVLogger, WandbLogger
    from your_lm import GPT2LM, loader

    import stabilize
    from stabilize.wandb_offline import find_offline_runs, read_offline_run

    torch.manual_seed(0)
    wandb = WandbLogger(save_dir=tmp_path, mode="offline", project="mine", anonymous=None)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    cb = stabilize.StabilityCallback(monitor={"curvature": {"every": 2}})
    trainer = L.Trainer(max_steps=4, accelerator="cpu", log_every_n_steps=1,
                        logger=[csv_logger, wandb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(GPT2LM(n_layer=2, n_embd=16, n_head=2), loader())
    wandb.experiment.finish()
    (offline,) = find_offline_runs(tmp_path / "wandb")
    history = read_offline_run(offline, wait_s=30).history
    # in W&B's own row order (its _step counts log calls, not Lightning's steps)
    in_wandb = [r["opt/curv_pre"] for r in sorted(history, key=lambda r: r["_step"])
                if "opt/curv_pre" in r]  # fmt: skip
    rows = read_csv_metrics(tmp_path)  # tmp_path/csv/version_0
    in_csv = {int(r["step"]): r["opt/curv_pre"] for r in rows if "opt/curv_pre" in r}
    assert sorted(in_csv) == [1, 3]  # the 2nd and 4th steps: one log step in 2
    assert in_wandb == pytest.approx([in_csv[1], in_csv[3]])
    assert any("g2_v/transformer.h.0" in r for r in history) and any("opt/g2_v" in r for r in rows)


@pytest.mark.slow  # two torchrun launches; the one-process run test above is its sibling
def test_on_two_ranks_the_curvature_is_measured_and_the_run_unchanged(tmp_path):
    """2 torchrun ranks (DDP, gloo), the curvature on every log step: every rank takes the
    pass together (its gradients all-reduced), the series is logged, and the losses are
    those of the same launch with it off, bit for bit."""
    from conftest import launch_sh

    args = [*[a for a in FAST if not a.startswith("trainer.progress")], "trainer.max_steps=6",
            "trainer.log_every_n_steps=2", "trainer.accelerator=cpu", "precision=fp32",
            "model.dropout=0.1"]  # fmt: skip
    rows = {}
    for tag, extra in (
        ("on", "monitor.curvature.every=1"),
        ("off", "monitor.curvature.enabled=false"),
    ):
        r = launch_sh(tmp_path / tag, *args, extra, cwd=tmp_path, nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        rows[tag] = read_csv_metrics(tmp_path / tag)
    losses = {t: [r["train/loss"] for r in rs if "train/loss" in r] for t, rs in rows.items()}
    assert len(losses["on"]) == 3 and losses["on"] == losses["off"]  # the log steps'
    held = [json.loads((tmp_path / t / "final_eval.json").read_text())["loss"] for t in rows]
    assert held[0] == held[1]  # the weights at the end, as the held-out score sees them
    curv = [r for r in rows["on"] if "opt/curv_pre" in r]
    assert len(curv) == 3 and all(math.isfinite(r["opt/curv_u"]) for r in curv)
