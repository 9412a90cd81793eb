"""Honest counts and per-step metrics.

- The probe tells a *dead* row (its 16-bit statistic overflowed while its input was finite
  in the reduction dtype: the output is exactly 0) from a *NaN-producing* row (its input is
  not finite once cast to the reduction dtype, e.g. |x| >= 65520 in fp16: the output is
  NaN), checked against an independent float64 computation on hand-built rows and, in a
  real fp16 run of the drift scenario, against forward hooks on the norms' inputs on the
  NaN step.
- The step's loss, grad norm and loss scale are logged on every step: a grad-norm spike
  planted between two log steps is in metrics.csv, and in the report's series, at its step.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from stabilize.model import GPT, GPTConfig
from stabilize.norms import Norm, get_norm_type
from stabilize.report import load_run_dir
from stabilize.report.summary import summarize
from stabilize.stability.probe import StabilityProbe
from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics

FP16_INF_FROM = 65520.0  # fp16 rounds |x| >= 65520 to inf (65504 is its largest finite)


def _rows(d: int) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """[n, d] fp32 rows of known fate in an fp16 reduction, and which is which."""
    g = torch.Generator().manual_seed(0)
    rows, kinds = [], {"finite": [], "dead": [], "nan": []}

    def add(kind, x):
        kinds[kind].append(len(rows))
        rows.append(x)

    for _ in range(4):
        add("finite", torch.randn(d, generator=g))
    for k in (0, 5, d - 1):  # one element at 300: its fp16 square (9e4) overflows
        x = torch.randn(d, generator=g)
        x[k] = 300.0
        add("dead", x)
    x = torch.zeros(d)
    x[1] = 65519.0  # rounds to 65504 in fp16: finite input, overflowed statistic
    add("dead", x)
    for k in (0, 7, d - 1):  # 7e4: not finite in fp16 (x.half() is inf)
        x = torch.randn(d, generator=g)
        x[k] = -7e4 if k == 7 else 7e4
        add("nan", x)
    for bad in (FP16_INF_FROM, float("nan"), -float("inf")):
        x = torch.randn(d, generator=g)
        x[3] = bad
        add("nan", x)
    return torch.stack(rows), kinds


def _reference(kind: str, x: torch.Tensor, eps: float):
    """Independent of the norm's code: which rows are finite in fp16, which statistics
    overflow (the exact sum of the fp16-rounded squares, in float64, past 65520: fp16 rounds
    it to inf), and the float64 output of the finite rows."""
    x16 = x.half()
    finite = torch.isfinite(x16).all(-1)
    xd = x16.double()
    if kind == "layernorm":
        xd = xd - xd.mean(-1, keepdim=True)
    sq = xd.square().half().double()  # each square rounded to fp16 as the norm stores it
    ss = sq.sum(-1)
    borderline = finite & ((ss - FP16_INF_FROM).abs() < 0.05 * FP16_INF_FROM)
    assert not borderline.any()  # no row whose fate hangs on a rounding
    overflow = finite & (ss >= FP16_INF_FROM)
    return finite, overflow, get_norm_type(kind).reference64(x16.double(), eps)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm", "scalenorm"])
def test_dead_and_nan_rows_are_told_apart_like_a_float64_reference(kind):
    cfg = GPTConfig.preset(
        "tiny", norm={"type": kind, "backend": "explicit", "reduction_dtype": "fp16"}
    )
    model = GPT(cfg).train()
    probe = StabilityProbe(model)
    name, norm = next((n, m) for n, m in model.named_modules() if isinstance(m, Norm))
    x, kinds = _rows(norm.dim)
    finite, overflow, ref = _reference(kind, x, norm.eps)
    # the rows are what they were built to be, by the reference's own reckoning
    assert finite.nonzero().flatten().tolist() == kinds["finite"] + kinds["dead"]
    assert overflow.nonzero().flatten().tolist() == kinds["dead"]

    probe.reset(detailed=False, device="cpu")
    x = x.requires_grad_()
    y = norm(x)
    got = probe.unpack(*(t.tolist() for t in probe.vector("cpu")))
    assert got["norm_collapsed"][name] == len(kinds["dead"])
    assert got["norm_nan_rows"][name] == len(kinds["nan"])
    # every dead row overflowed; so did the inf-input rows whose statistic is inf (not NaN)
    assert got["norm_overflow"][name] >= len(kinds["dead"])

    # the outputs the counts stand for
    fin, dead, nan = (torch.tensor(kinds[k]) for k in ("finite", "dead", "nan"))
    with torch.no_grad():  # gamma (ScaleNorm's is sqrt(D)) and beta, as initialized
        ref = ref * norm.weight.double() + (0 if norm.bias is None else norm.bias.double())
    torch.testing.assert_close(y[fin].double(), ref[fin], rtol=4e-3, atol=4e-3)
    assert (y[dead] == 0).all()  # exactly zero: a dead token ...
    assert torch.isnan(y[nan]).any(-1).all()  # ... and a NaN source, not one
    keep = torch.cat([fin, dead])
    w = torch.randn(len(keep), y.shape[-1], generator=torch.Generator().manual_seed(1))
    (y[keep] * w).sum().backward()  # weighted: LayerNorm's plain sum has a zero gradient
    assert (x.grad[dead[:3]] == 0).all()  # ... with a zero gradient: silently dead
    assert (x.grad[fin] != 0).any()
    # but a dead row holding |x| >= 32752 gets a NaN gradient: the fp16 square's backward
    # forms 2x, inf in fp16, times the zero from rsqrt(inf) (measured here, not assumed)
    assert torch.isnan(x.grad[dead[3]]).any()
    probe.remove()


# ---- a real fp16 run: the outlier drift past fp16's max, in the scenario's recipe -----------
# (one channel of block 0's update driven through 256 at CROSS and on to 1e5 > 65504, on
# GPT-2's init: the NaN step has rows whose input is not finite in fp16)
CROSS, START, STEPS = 25, 10, 45
SHORT = [
    *FAST,  # every step logged
    "experiment=nan_repro",
    "fault=activation_drift",
    "fault.channels=1",
    "fault.target=1e5",
    "fault.target_step=null",
    "model.init_std=0.02",
    "logger=none",
    f"trainer.max_steps={STEPS}",
    f"fault.step={START}",
    f"fault.cross_step={CROSS}",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
]


class NormInputs(L.Callback):
    """Independent forward pre-hooks on every norm: each training step's inputs, by the
    model step they belong to (the NaN localization's no-grad replay is left out)."""

    def __init__(self):
        self.by_step: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._step = None

    def setup(self, trainer, pl_module, stage):
        for n, m in pl_module.model.named_modules():
            if isinstance(m, Norm):
                m.register_forward_pre_hook(lambda m, a, n=n: self._keep(m, n, a[0]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = pl_module.train_state.model_step + 1
        self.by_step[self._step] = {}

    def _keep(self, module, name, x):
        if module.training and torch.is_grad_enabled() and self._step is not None:
            self.by_step[self._step].setdefault(name, []).append(x.detach().float().clone())


def test_on_the_nan_step_the_probe_counts_match_hooks_on_the_norm_inputs(tmp_path):
    hooks = NormInputs()
    run(compose_run(tmp_path, [*SHORT, "arm=baseline"]), callbacks=[hooks])
    evs = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    nan_step = next(e["step"] for e in evs if e["monitor"] == "nonfinite")
    logged = next(
        r
        for r in read_csv_metrics(tmp_path)
        if r.get("train/step") == nan_step and any(k.startswith("nan_rows/") for k in r)
    )
    total_nan = 0
    for name, xs in hooks.by_step[nan_step].items():
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
        finite, overflow, _ = _reference("rmsnorm", x, 1e-5)
        assert logged[f"nan_rows/{name}"] == int((~finite).sum()), name
        assert logged[f"dead/{name}"] == int(overflow.sum()), name
        total_nan += int((~finite).sum())
    assert total_nan > 0  # the NaN step has NaN sources: rows past fp16's range
    # the overflow event of that step says so, apart from the dead rows
    over = [e for e in evs if e["monitor"] == "overflow" and e["step"] == nan_step]
    assert over and sum(e["extra"]["nan_rows"] for e in over) > 0
    assert "output NaN" in over[0]["message"]
    # every row that went NaN, on every step, is in the events and the report's sum: also
    # those of steps (and norms) where no row overflowed beside them
    ref_total = 0
    for xs_by_norm in hooks.by_step.values():
        for xs in xs_by_norm.values():
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])
            # not finite once cast to the fp16 reduction (|x| >= 65520, inf, NaN): NaN out
            ref_total += int((~torch.isfinite(x.half())).any(-1).sum())
    counted = [e for e in evs if e["monitor"] in ("overflow", "nan_rows")]
    assert any(e["monitor"] == "nan_rows" for e in counted)  # NaN rows with no overflow
    assert sum(e["extra"]["nan_rows"] for e in counted) == ref_total
    assert summarize(load_run_dir(tmp_path)).nan_rows == ref_total  # the report's NaN rows


# ---- per-step metrics -----------------------------------------------------------------------
def test_a_grad_norm_spike_between_log_steps_is_logged_at_its_step(tmp_path):
    spike = 13  # not a log step: log_every_n_steps=10
    cfg = compose_run(
        tmp_path,
        [
            *FAST,
            "logger=none",
            "trainer.max_steps=20",
            "trainer.log_every_n_steps=10",
            "trainer.val_check_interval=100",
            "trainer.checkpoint_every_n_steps=100",
            "rollback=off",
            "fault=grad_spike",
            f"fault.step={spike}",
            "fault.factor=100",
        ],
    )
    run(cfg)
    rows = read_csv_metrics(tmp_path)
    per_step = {
        int(r["train/step"]): r["train/grad_norm_step"] for r in rows if "train/grad_norm_step" in r
    }
    assert sorted(per_step) == list(range(1, 21))  # every step, not every 10th
    assert max(per_step, key=per_step.get) == spike
    assert per_step[spike] > 20 * sorted(per_step.values())[len(per_step) // 2]
    assert all(math.isfinite(r["train/loss_step"]) for r in rows if "train/loss_step" in r)
    # Lightning's own train/grad_norm is on log steps only: it misses the spike
    lightning = [r["train/grad_norm"] for r in rows if "train/grad_norm" in r]
    assert len(lightning) == 2 and max(lightning) < per_step[spike] / 20
    # the report reads the per-step series under the plain name, and finds the peak
    r = load_run_dir(tmp_path)
    series = {int(row["train/step"]): v for row in r.rows if (v := row.get("train/grad_norm"))}
    assert series == pytest.approx(per_step)
    assert not any("train/grad_norm_step" in row for row in r.rows)
