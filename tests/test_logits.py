"""Attention and output logits and per-block gradient / update norms
(item 5): the probe's new statistics against float64 references on a real training step,
the logit monitors on synthetic series and on real runs, z-loss, soft cap, the z_loss rung."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from test_stability import events

from stabilize import cpu_kernels
from stabilize.lit.stability import StabilityCallback
from stabilize.model import GPT, GPTConfig
from stabilize.model.logits import lm_loss
from stabilize.monitors import WARN, StepStats
from stabilize.monitors.logits import (
    AttnEntropyConfig,
    AttnEntropyMonitor,
    AttnLogitConfig,
    AttnLogitMonitor,
    LogZConfig,
    LogZMonitor,
    loglinear_forecast,
)
from stabilize.train import run

from conftest import FAST, compose_run

BASE = [
    *FAST,
    "logger=none",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    "rollback.durable_every=0",
    "model.block_size=32",
]


# ---- the model's options ------------------------------------------------------------------
def test_softcap_50_keeps_every_logit_within_50_where_the_raw_logits_pass_it():
    torch.manual_seed(0)
    m = GPT(GPTConfig(logit_softcap=50.0))
    with torch.no_grad():
        m.wte.weight.mul_(40)  # the tied head's logits reach the hundreds
    raw = {}
    m.lm_head.register_forward_hook(lambda mod, a, out: raw.setdefault("x", out.double()))
    logits = m(torch.randint(0, 256, (2, 16)))
    assert raw["x"].abs().max() > 100  # the cap has work to do
    assert logits.abs().max() <= 50
    torch.testing.assert_close(
        logits.double(), 50 * torch.tanh(raw["x"] / 50), rtol=1e-5, atol=1e-5
    )
    off = GPT(GPTConfig())
    off.load_state_dict(m.state_dict())  # no parameter of its own: the same state dict
    assert off(torch.zeros(1, 4, dtype=torch.long)).abs().max() > 50


def test_lm_loss_adds_the_z_loss_of_a_float64_reference():
    torch.manual_seed(0)
    logits, y = torch.randn(2, 5, 11) * 4 + 3, torch.randint(0, 11, (2, 5))
    x = logits.double().flatten(0, 1)
    lse = torch.log(torch.exp(x).sum(-1))
    ce = (lse - x[torch.arange(10), y.flatten()]).mean()
    torch.testing.assert_close(lm_loss(logits, y).double(), ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        lm_loss(logits, y, 1e-2).double(), ce + 1e-2 * lse.square().mean(), rtol=1e-6, atol=1e-6
    )


def test_the_loss_site_computes_in_the_logits_dtype_only_when_asked_and_not_under_autocast():
    """model.loss_dtype=logits (upcast=False): bf16 logits give a bf16 loss whose error
    against float64 is bf16's; the default upcasts (fp32's error). Under CPU autocast
    PyTorch runs the cross-entropy in fp32 anyway: the site matters under bf16-true."""
    torch.manual_seed(0)
    logits, y = (torch.randn(4, 32, 101) * 4 + 30).bfloat16(), torch.randint(0, 101, (4, 32))
    x = logits.double().flatten(0, 1)
    ce = (torch.logsumexp(x, -1) - x[torch.arange(128), y.flatten()]).mean()  # float64
    up, low = lm_loss(logits, y), lm_loss(logits, y, upcast=False)
    assert up.dtype == torch.float32 and abs(up.double() - ce) < 1e-5
    assert low.dtype == torch.bfloat16 and abs(low.double() - ce) > 1e-3  # ~ half a bf16 ulp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = lm_loss(logits, y, upcast=False)
    assert auto.dtype == torch.float32 and abs(auto.double() - ce) < 1e-5


# ---- the probe's new statistics on a real step, against float64 --------------------------
class Reference(L.Callback):
    """On the last step: float64 copies of the pre-clip gradients and the weights before
    and after the update, the final logits and one sequence's q and k of every block."""

    def __init__(self, last: int):
        self.last, self.handles, self.qk = last, [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.train_state.model_step + 1 != self.last:
            return
        model = pl_module.model
        self.handles.append(
            model.logit_softcap.register_forward_hook(
                lambda m, a, out: setattr(self, "logits", out.detach().double())
            )
        )
        for i, block in enumerate(model.h):
            for name in ("q", "k"):
                mod = getattr(block.attn, f"{name}_norm")
                self.handles.append(
                    mod.register_forward_hook(
                        lambda m, a, out, key=(i, name): self.qk.__setitem__(key, out.double())
                    )
                )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.train_state.model_step + 1 == self.last:
            named = dict(pl_module.model.named_parameters())
            self.before = {k: p.detach().double().clone() for k, p in named.items()}
            self.grads = {k: p.grad.double().clone() for k, p in named.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.train_state.model_step == self.last and not hasattr(self, "after"):
            named = dict(pl_module.model.named_parameters())
            self.after = {k: p.detach().double().clone() for k, p in named.items()}
            sc = next(c for c in trainer.callbacks if isinstance(c, StabilityCallback))
            self.stats = sc.last
            for h in self.handles:
                h.remove()


def _group(name: str) -> str:
    return f"h.{name.split('.')[1]}" if name.startswith("h.") else "other"


def test_probe_logit_entropy_grad_and_update_norms_match_float64_on_a_real_step(tmp_path):
    """log Z, the attention bound, the lowest head entropy, the per-block gradient and update
    norms, each against float64 on the run's last step. The bound is head_norm_max's kernel
    wherever it builds (built here first, not left to whichever test ran before)."""
    cpu_kernels.available()
    ref = Reference(last=3)
    run(compose_run(tmp_path, [*BASE, "trainer.max_steps=3", "optim.lr=1e-2"]), callbacks=[ref])
    s = ref.stats
    assert s.step == 3
    # log Z of the step's logits
    lse = torch.logsumexp(ref.logits, -1)
    assert s.log_z["mean"] == pytest.approx(lse.mean().item(), rel=1e-5)
    assert s.log_z["max"] == pytest.approx(lse.max().item(), rel=1e-5)
    # the lowest head entropy: every row of sequence 0 (T = 32 < ROWS), causal softmax
    for i in range(2):
        qb, kb = ref.qk[(i, "q")], ref.qk[(i, "k")]  # [B, H, T, d], every sequence
        # the attention bound: per head max|q| max|k| / sqrt(d) over every sequence and row
        qn, kn = (x.square().sum(-1).sqrt().amax(dim=(0, 2)) for x in (qb, kb))
        bound = ((qn * kn).amax() / math.sqrt(qb.shape[-1])).item()
        assert s.attn_logit[f"h.{i}.attn"] == pytest.approx(bound, rel=1e-5)
        q, k = qb[0], kb[0]  # [H, T, d]
        t = q.shape[1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        p = scores.softmax(-1)
        ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1).mean(-1)
        assert s.attn_entropy[f"h.{i}.attn"] == pytest.approx(ent.min().item(), rel=1e-4, abs=1e-6)
    # per block: the pre-clip gradient norm, and the update's norm over the weights' norm
    groups = {}
    for name in ref.grads:
        groups.setdefault(_group(name), []).append(name)
    assert set(groups) == set(s.layer_grad_norm) == set(s.update_ratio) == {"h.0", "h.1", "other"}
    for g, names in groups.items():
        gn = math.sqrt(sum(ref.grads[n].square().sum().item() for n in names))
        dw = math.sqrt(sum((ref.after[n] - ref.before[n]).square().sum().item() for n in names))
        w = math.sqrt(sum(ref.before[n].square().sum().item() for n in names))
        assert s.layer_grad_norm[g] == pytest.approx(gn, rel=1e-5)
        assert s.update_ratio[g] == pytest.approx(dw / w, rel=2e-3)
    total = math.sqrt(sum(v.square().sum().item() for v in ref.grads.values()))
    assert total > 1.0  # clipping (at 1.0) scaled this update: the ratio followed it


# ---- the monitors on synthetic series -----------------------------------------------------
def test_loglinear_forecast_recovers_a_line_through_outliers():
    logs = [math.log(200) + 0.05 * i for i in range(16)]
    logs[3] += 5.0  # two wild steps
    logs[9] -= 4.0
    level, slope, left = loglinear_forecast(logs, math.log(1e4))
    assert slope == pytest.approx(0.05) and level == pytest.approx(logs[-1])
    assert left == pytest.approx((math.log(1e4) - logs[-1]) / 0.05)
    assert loglinear_forecast([1.0] * 8, 2.0)[2] == math.inf  # flat: never
    assert loglinear_forecast([3.0] * 8, 2.0)[2] == 0.0  # past it


def stats(step, **kw) -> StepStats:
    return StepStats(step=step, loss=1.0, **kw)


def test_attn_logit_monitor_forecasts_a_rising_bound_then_reports_the_crossing_once():
    mon = AttnLogitMonitor(AttnLogitConfig(window=8, horizon=100))
    got = []
    for step in range(1, 120):
        v = 150 * 1.05**step  # x1.05 per step from 150: crosses 1e4 at step 86
        got += [(step, e) for e in mon.update(stats(step, attn_logit={"h.0.attn": v}))]
    (first, fc), (cross, ev) = got
    assert fc.kind == WARN and "crosses 10000 in ~" in fc.message
    assert first == 8 and fc.value == pytest.approx(86 - 8, abs=1)  # on the first full window
    assert cross == 87 and "crossed 10000" in ev.message  # and once only
    state = mon.state_dict()
    again = AttnLogitMonitor(AttnLogitConfig(window=8))
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == state


def test_attn_logit_monitor_is_quiet_on_a_flat_bound_like_qk_norms():
    mon = AttnLogitMonitor(AttnLogitConfig(window=8))
    torch.manual_seed(0)
    noisy = (12 * (1 + 0.2 * torch.randn(300))).tolist()
    assert not [e for s, v in enumerate(noisy) for e in mon.update(stats(s, attn_logit={"b": v}))]
    # a rise that stays far below forecast_min is no forecast either
    assert not [e for s in range(300) for e in mon.update(stats(s, attn_logit={"c": 1.01**s}))]


def test_attn_entropy_warns_once_per_collapse_and_log_z_once_per_crossing():
    ent = AttnEntropyMonitor(AttnEntropyConfig(floor=0.05))
    series = [2.0, 0.03, 0.06, 0.01, 0.8, 0.02]  # collapse, flicker, recover, collapse again
    warned = [s for s, e in enumerate(series) if ent.update(stats(s, attn_entropy={"h.0.attn": e}))]
    assert warned == [1, 5]
    assert ent.update(stats(9)) == []  # not a log step: nothing measured, nothing said
    lz = LogZMonitor(LogZConfig(threshold=50))
    vals = [5.0, 60.0, 70.0, 6.0, float("nan"), 80.0]
    out = [lz.update(stats(s, log_z={"mean": v, "max": v})) for s, v in enumerate(vals)]
    assert [bool(o) for o in out] == [False, True, False, False, False, True]  # NaN: not z-loss


def test_a_non_finite_model_gets_no_entropy_or_z_loss_advice():
    """The NaN is the verdict (the nonfinite monitor's): a NaN or collapsed-looking head and
    a huge log Z on a step whose loss is not finite say nothing; the same values on a
    finite step do."""
    ent, lz = (
        AttnEntropyMonitor(AttnEntropyConfig(floor=0.05)),
        LogZMonitor(LogZConfig(threshold=50)),
    )
    nan = float("nan")
    for s, loss in enumerate((nan, float("inf"))):
        st = stats(s, attn_entropy={"h.0.attn": 0.001, "h.1.attn": nan},
                   log_z={"mean": 90.0, "max": 90.0})  # fmt: skip
        st.loss = loss
        assert ent.update(st) == [] and lz.update(st) == []
    st = stats(2, attn_entropy={"h.0.attn": nan}, log_z={"mean": nan, "max": nan})
    assert ent.update(st) == [] and lz.update(st) == []  # finite loss, NaN values: no advice
    st = stats(3, attn_entropy={"h.0.attn": 0.001}, log_z={"mean": 90.0, "max": 90.0})
    assert [e.monitor for e in ent.update(st) + lz.update(st)] == ["attn_entropy", "log_z"]


# ---- real runs ----------------------------------------------------------------------------
class Last(L.Callback):
    """The run's last StepStats and the model's z-loss coefficient at the end."""

    def on_train_end(self, trainer, pl_module):
        self.stats = next(c for c in trainer.callbacks if isinstance(c, StabilityCallback)).last
        self.z_loss = pl_module.model.z_loss


@pytest.mark.slow  # two 16-step runs: ~30 s on 2 idle cores; the synthetic tests above stay
def test_without_qk_norm_a_high_lr_run_is_warned_before_its_logits_cross_and_with_it_not(tmp_path):
    common = [*BASE, "trainer.max_steps=16", "optim.lr=3e-2", "rollback=off"]
    common += ["monitor.attn_logit.window=8"]
    for qk in (False, True):
        last = Last()
        rd = tmp_path / f"qk-{qk}"
        run(compose_run(rd, [*common, f"norm.qk_norm={qk}"]), callbacks=[last])
        warned = [e for e in events(rd) if e["monitor"] == "attn_logit"]
        bound = max(last.stats.attn_logit.values())
        if qk:
            assert warned == [] and bound < 100  # measured ~12
        else:
            first = warned[0]
            assert first["kind"] == "warn" and "crosses 10000 in ~" in first["message"]
            assert first["value"] < 100  # steps left, within the horizon
            assert bound > 100 and math.isfinite(last.stats.loss)  # rising; not diverged


def test_z_loss_lowers_log_z_against_the_same_run_without_it(tmp_path):
    got = {}
    for z in (0.0, 0.1):
        last = Last()
        rd = tmp_path / f"z-{z}"
        over = [*BASE, "trainer.max_steps=6", "optim.lr=1e-2", f"model.z_loss={z}"]
        run(compose_run(rd, over), callbacks=[last])
        got[z] = last.stats.log_z
    # log Z starts at ~log(256) = 5.5 in both (same seed, data, init)
    assert got[0.1]["mean"] < got[0.0]["mean"] - 1.0
    assert got[0.1]["max"] < got[0.0]["max"]


def test_the_z_loss_rung_switches_z_loss_on_after_a_rollback_and_a_checkpoint_keeps_it(tmp_path):
    last = Last()
    over = [*BASE, "trainer.max_steps=8", "fault=nan_loss", "fault.step=5"]
    over += ["rollback.snapshot_every=2", "rollback.ladder=[z_loss]"]
    over += ["rollback.remedy.z_loss.weight=3e-4"]
    run(compose_run(tmp_path, over), callbacks=[last])
    (rb,) = [e for e in events(tmp_path) if "remedy" in e["extra"]]
    assert rb["extra"]["remedy"] == "z_loss" and rb["extra"]["z_loss"] == 3e-4
    assert rb["extra"]["z_loss_before"] == 0.0 and last.z_loss == 3e-4
    # the coefficient is in the checkpoint, and a resumed module takes it back
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["z_loss"] == 3e-4 and ckpt["stabilize"]["remedies"] == ["z_loss"]
    from stabilize.lit.module import GPTLitModule

    fresh = GPTLitModule(compose_run(tmp_path / "other", over))
    assert fresh.model.z_loss == 0.0
    fresh.on_load_checkpoint(ckpt)
    assert fresh.model.z_loss == 3e-4


def test_log_z_of_16_bit_logits_in_chunks_equals_float64():
    """No full fp32 copy of 16-bit logits: converted a chunk of rows at a time, each row's
    logsumexp the same as a float64 one of the same values (and as the one-shot fp32)."""
    from stabilize.model.logits import log_z

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(3, 70, 500, generator=g) * 8).to(dtype)
        ref = torch.logsumexp(x.double(), dim=-1)
        chunked = log_z(x, chunk_elems=500 * 16)  # 16 rows at a time: 14 chunks
        assert chunked.dtype == torch.float32 and chunked.shape == (3, 70)
        torch.testing.assert_close(chunked.double(), ref, rtol=1e-6, atol=1e-5)
        assert torch.equal(chunked, torch.logsumexp(x.float(), dim=-1))


def test_the_loss_hands_its_own_log_z_to_the_probe_without_changing_the_loss():
    """lm_loss with a sink: the same loss and gradient, bit for bit, as F.cross_entropy; the
    sink's log Z (x_y - log_softmax(x)_y) equals a float64 logsumexp of the same logits, for
    fp32 and 16-bit logits, with logits near 0 and far from it."""
    import torch.nn.functional as F

    from stabilize.model.logits import lm_loss

    class Sink:
        def record_log_z(self, lz):
            self.lz = lz

    g = torch.Generator().manual_seed(0)
    for dtype, scale, shift in (
        (torch.float32, 3, 0),
        (torch.float32, 8, 40),
        (torch.bfloat16, 8, 0),
    ):
        x = (torch.randn(2, 33, 300, generator=g) * scale + shift).to(dtype)
        y = torch.randint(0, 300, (2, 33), generator=g)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        sink = Sink()
        got = lm_loss(a, y, sink=sink)
        want = F.cross_entropy(b.flatten(0, 1).float(), y.flatten())
        assert torch.equal(got, want)
        got.backward()
        want.backward()
        assert torch.equal(a.grad, b.grad)
        ref = torch.logsumexp(x.double(), dim=-1).flatten()
        assert sink.lz.dtype == torch.float32 and not sink.lz.requires_grad
        torch.testing.assert_close(sink.lz.double(), ref, rtol=1e-6, atol=1e-5)
