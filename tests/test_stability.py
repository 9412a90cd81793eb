"""Monitors + faults + rollback through a real Lightning Trainer on CPU (tiny model)."""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from benchmarks.drills import DRILL_MONITORS
from stabilize.rollback import load_durable
from stabilize.rollback.state import TrainState
from stabilize.stability import StabilityAbort
from stabilize.train import run

from conftest import FAST, compose_run, read_csv_metrics, run_cli, series, torchrun

BASE = [
    *FAST,
    "logger=none",
    "trainer.max_steps=14",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    *DRILL_MONITORS,
]


def drift_fault(cross_step: int) -> list[str]:
    """Activation drift from step 3 on one channel of block 0, crossing 256 on
    ``cross_step``; an fp16 reduction, so that the crossing overflows a sum of squares
    (|x| > 255.94), and an overflow is a rollback verdict."""
    return [
        "fault=activation_drift",
        f"fault.cross_step={cross_step}",  # the step the test reads (second item)
        "fault.step=3",
        "fault.target_step=null",
        "fault.channels=1",
        "norm=rmsnorm",
        "norm.reduction_dtype=fp16",
        # at std 0.02 the fp16 reduction's backward overflows from step 1 (the
        # embeddings' RMS ~0.03: docs/scenario.md); wider weights train
        "model.init_std=0.1",
        "monitor.activation.on_overflow=rollback",
    ]


def events(run_dir) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kinds(evs, kind):
    return [e for e in evs if e["kind"] == kind]


@pytest.mark.parametrize(
    "fault, monitor, cls, remedy",
    [
        # transient: the replay of the step is clean (the fault fired once)
        (["fault=nan_loss", "fault.step=7"], "nonfinite", "transient", "retry"),
        (
            ["fault=inf_grad", "fault.step=7", "fault.param=h.1.mlp.c_fc.weight"],
            "nonfinite",
            "transient",
            "retry",
        ),
        (
            ["fault=grad_spike", "fault.step=11", "fault.factor=1e4"],
            "grad_spike",
            "transient",
            "retry",
        ),
        # deterministic: the drift overflows the replay and the next batch alike; the
        # overflow's own rung first
        (drift_fault(cross_step=9), "overflow", "deterministic", "fp32_reduction"),
    ],
)
def test_each_fault_is_detected_classified_rolled_back_and_training_goes_on(
    fault, monitor, cls, remedy, tmp_path
):
    out = run(compose_run(tmp_path, [*BASE, *fault]))
    step = int(fault[1].split("=")[1])
    evs = events(tmp_path)
    rb = kinds(evs, "rollback")
    # the verdicts (one per overflowed norm for the drift), all of this step and monitor
    verdicts = [e for e in rb if e["monitor"] != "rollback"]
    assert {(e["monitor"], e["step"]) for e in verdicts} == {(monitor, step)}
    assert verdicts[0]["extra"]["class"] == cls  # the first verdict is the one acted on
    (done,) = [e for e in rb if e["monitor"] == "rollback"]
    assert done["extra"]["restored_step"] <= step - 1 and done["extra"]["remedy"] == remedy
    assert done["extra"]["class"] == cls
    if cls == "transient":  # the one process is the one to blame, and it is counted
        assert verdicts[0]["extra"]["ranks"] == [0]
        assert done["extra"]["transients_per_rank"] == {"0": 1}
    assert out["model_step"] == 14  # the model's budget, not Lightning's global_step
    assert out["global_step"] > 14  # the replayed steps count for Lightning
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["stabilize"]["model_step"] == 14
    assert ckpt["stabilize"]["remedies"] == [remedy]
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert ckpt["stabilize"]["data_step"] == 14  # no batch skipped


def test_rollback_with_retry_replays_bit_identically(tmp_path):
    """A transient fault, rolled back with no remedy: the run ends exactly where the
    fault-free run ends (CPU, fp32), dropout included."""
    common = [*BASE, "model.dropout=0.1", "rollback.ladder=[retry]"]
    clean = run(compose_run(tmp_path / "clean", common))
    hit = run(compose_run(tmp_path / "hit", [*common, "fault=nan_loss", "fault.step=9"]))
    assert len(kinds(events(tmp_path / "hit"), "rollback")) == 2  # the fault + the restore
    assert hit["global_step"] > clean["global_step"]
    a = torch.load(tmp_path / "clean" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "hit" / "checkpoints" / "last.ckpt", weights_only=False)
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    la, lb = (
        series(read_csv_metrics(tmp_path / "clean"), "train/loss"),
        series(read_csv_metrics(tmp_path / "hit"), "train/loss"),
    )
    assert list(la.values())[-3:] == list(lb.values())[-3:]


def test_persistent_fault_is_deterministic_exhausts_the_numerics_and_aborts(tmp_path):
    """A fault that recurs on the replay and on the next batch: deterministic. Its remedies
    are the ladder's numerics rungs (not retry, not skip_batch); each replay localizes it
    in the backward: the gradient of h.1.mlp.c_fc's weight went inf while the gradient
    reaching the module was finite."""
    t0 = time.time()
    inf_grad = ["fault=inf_grad", "fault.param=h.1.mlp.c_fc.weight"]
    with pytest.raises(StabilityAbort) as e:
        run(compose_run(tmp_path, [*BASE, *inf_grad, "fault.step=5", "fault.persistent=true"]))
    assert time.time() - t0 < 120
    d = e.value.diagnosis
    assert "ladder" in d["reason"] and d["monitor"] == "nonfinite" and d["step"] == 5
    # its norms already reduce in fp32: that rung would change nothing, so it is passed
    # over and named, and the ladder is exhausted after lower_lr
    assert d["remedies"] == ["lower_lr"]
    assert "fp32_reduction skipped: every norm already reduces in fp32" in d["reason"]
    assert [h["remedy"] for h in d["rollbacks"]] == d["remedies"]
    assert {h["class"] for h in d["rollbacks"]} == {"deterministic"}
    saved = json.loads((tmp_path / "diagnosis.json").read_text())
    assert saved["reason"] == d["reason"]
    # named live from the step's own gradients too (grad_scan.py), in the diagnosis
    assert saved["grad_scan"]["grad_module"] == "h.1.mlp.c_fc"
    assert kinds(events(tmp_path), "abort")
    verdicts = [e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "nonfinite"]
    assert len(verdicts) == 2  # the first one's rollback (lower_lr), then the abort's
    for v in verdicts:
        (loc,) = v["extra"]["localization"]
        assert loc["grad_module"] == "h.1.mlp.c_fc" and loc["grad_incoming_finite"] is True
        assert loc["module"] is None  # the forward was finite
        assert v["extra"]["other_batches"]["positions"] == [5]  # the next batch failed too


def test_cli_exits_3_on_abort(tmp_path):
    r = run_cli(
        [
            "stabilize-train",
            *BASE,
            "fault=nan_loss",
            "fault.step=4",
            "fault.persistent=true",
            "rollback.ladder=[retry]",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 3, r.stderr[-2000:]
    # the console's last words read from what the run wrote: the diagnosis and its events
    diag = json.loads((tmp_path / "diagnosis.json").read_text())
    rolled = [e for e in events(tmp_path) if e["monitor"] == "rollback" and e["kind"] == "rollback"]
    assert f"stability abort at step {diag['step']}: {diag['reason']}" in r.stderr
    assert "remedy ladder" in diag["reason"]
    assert f"the verdict: {diag['monitor']}" in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.lstrip().startswith("rollback ")]
    assert len(lines) == len(rolled) == len(diag["rollbacks"]) >= 1
    assert all("remedy retry" in ln for ln in lines)
    assert f"diagnosis: {tmp_path / 'diagnosis.json'}" in r.stderr
    assert "{" not in r.stderr.split("stability abort at step")[1]  # no JSON dump


def test_activation_drift_reaches_its_target_on_time_and_is_warned_before(tmp_path):
    out = run(
        compose_run(
            tmp_path,
            [
                *BASE,
                "trainer.max_steps=30",
                "fault=activation_drift",
                "fault.layer=0",
                "fault.step=6",
                "fault.target=2000",
                "fault.target_step=26",
                "rollback=off",
                "monitor.activation.forecast.horizon=15",
                "monitor.activation.forecast.window=8",
                "monitor.activation.line=fp16_square",  # fp32: the forecast runs when asked
            ],
        )
    )
    assert out["model_step"] == 30
    rows = read_csv_metrics(tmp_path)
    act = {int(r["train/step"]): r["act/h.0"] for r in rows if "act/h.0" in r}
    # geometric path from the level at step 6 to 2000 at step 26: within 2x at the target
    assert 1000 < act[26] < 4000, act
    first_over = min(s for s, v in act.items() if v > 256)
    assert 15 < first_over < 26
    evs = events(tmp_path)
    # h.0's output is h.1.ln_1's input, one tensor: judged once, as the norm that reads it
    crossed = [e for e in evs if e["monitor"] == "activation" and e["layer"] == "h.1.ln_1"]
    warned = [e for e in evs if e["monitor"] == "forecast" and e["layer"] == "h.1.ln_1"]
    assert not [e for e in evs if e["layer"] == "h.0"]
    assert crossed and crossed[0]["step"] == first_over
    assert warned and warned[0]["step"] < first_over  # the forecast came first


def test_fp16_reduction_overflow_is_counted_as_dead_tokens(tmp_path):
    run(
        compose_run(
            tmp_path,
            [
                *BASE,
                "trainer.max_steps=16",
                "norm=rmsnorm",
                "norm.reduction_dtype=fp16",
                "precision=fp16-mixed",
                "fault=activation_drift",
                "fault.layer=0",
                "fault.step=4",
                "fault.target=3000",
                "fault.target_step=14",
                "rollback=off",
            ],
        )
    )
    rows = read_csv_metrics(tmp_path)
    over = [r["overflow/h.1.ln_1"] for r in rows if "overflow/h.1.ln_1" in r]
    dead = [r["dead/h.1.ln_1"] for r in rows if "dead/h.1.ln_1" in r]
    assert over[0] == 0 and max(over) > 0  # none at first, then the fp16 sum overflows
    assert max(dead) > 0  # finite inputs whose rows came out as zeros
    assert any(e["monitor"] == "overflow" for e in events(tmp_path))


WRITER_ARGS = [
    *BASE,
    "trainer.max_steps=400",
    "rollback.snapshot_every=1",
    "rollback.durable_every=1",
    "rollback.keep=2",
    "rollback.keep_durable=-1",  # every file stays: the kill lands among many writes
]


def test_sigkill_during_durable_snapshots_leaves_them_loadable(tmp_path):
    import subprocess

    env_run = {"STABILIZE_RUN_DIR": str(tmp_path)}
    import os

    env = {**os.environ, **env_run, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    p = subprocess.Popen(
        ["stabilize-train", *WRITER_ARGS],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    snaps = tmp_path / "snapshots"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(snaps.glob("snapshot-*.pt"))) < 5:
        time.sleep(0.2)
    time.sleep(0.37)
    p.send_signal(signal.SIGKILL)
    p.wait()
    files = sorted(snaps.glob("snapshot-*.pt"))
    assert len(files) >= 5
    for f in files:
        s = load_durable(f)
        assert s.state["model_step"] == s.step
        assert all(torch.isfinite(v).all() for v in s.state["model"].values())


BITFLIP = ["fault=bitflip", "fault.param=h.1.mlp.c_fc.weight"]


# The faults on rank 1 under torchrun: (overrides, monitor, step, class, ranks blamed).
RANK1_FAULTS = {
    # transient: rank 1's loss alone differs between the step and its replay
    "nan_loss": (["fault=nan_loss", "fault.step=6"], "nonfinite", 6, "transient", [1]),
    # data-linked: data position 5 (step 6) fails on its replay, position 6 does not
    "poisoned_batch": (["fault=poisoned_batch", "fault.batch=5"], "nonfinite", 6, "data", None),
    # an exponent bit of rank 1's reduced gradient (1e-3 -> 2^118: its square overflows
    # rank 1's grad norm), rank 1's alone
    "bitflip-grad": (
        [*BITFLIP, "fault.flip=grad", "fault.bit=30", "fault.step=10"],
        "nonfinite",
        10,
        "transient",
        [1],
    ),
    # a mantissa bit of rank 1's weight: silent but for the replica check (every 4
    # steps: the flip at step 5 is named at step 8, within N)
    "bitflip-param": (
        [*BITFLIP, "fault.bit=20", "fault.step=5", "monitor.replicas.every=4"],
        "replicas",
        8,
        "transient",
        [1],
    ),
    "drift": (drift_fault(cross_step=8), "overflow", 8, "deterministic", None),
}
SLOW_RANK1 = ("bitflip-grad",)  # ~14 s; the same class and monitor as nan_loss's case


def rank1_runs(names, root: Path) -> dict[str, Path]:
    """One torchrun (2 ranks, gloo) that trains each named case in turn (tests/runs_worker.py:
    one Lightning import per rank for all of them), every rank in ``root/<name>``."""
    args = [a for a in BASE if not a.startswith("trainer.progress")]
    common = [*args, "trainer.accelerator=cpu", "trainer.max_steps=12", "fault.rank=1"]
    cases = {n: [*common[:-1], *RANK1_FAULTS[n][0], common[-1]] for n in names}
    (root / "cases.json").write_text(json.dumps(cases))
    torchrun("runs_worker.py", str(root / "cases.json"), str(root / "runs"), cwd=root)
    return {n: root / "runs" / n for n in names}


@pytest.fixture(scope="module")
def rank1(tmp_path_factory) -> dict[str, Path]:
    names = [n for n in RANK1_FAULTS if n not in SLOW_RANK1]
    return rank1_runs(names, tmp_path_factory.mktemp("rank1"))


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RANK1 else n for n in RANK1_FAULTS],
)
def test_torchrun_fault_on_rank_1_is_classified_and_rolls_back_every_rank(name, request, tmp_path):
    if name in SLOW_RANK1:
        run_dir = rank1_runs([name], tmp_path)[name]
    else:
        run_dir = request.getfixturevalue("rank1")[name]
    _, monitor, step, cls, blamed = RANK1_FAULTS[name]
    assert not (run_dir / "crash.txt").exists(), (run_dir / "crash.txt").read_text()
    evs = events(run_dir)
    # the verdicts (one per overflowed norm for the drift), all of this step and monitor;
    # every 10 steps (step 10 here) the replicas were checked and agreed otherwise
    verdicts = [e for e in kinds(evs, "rollback") if e["monitor"] != "rollback"]
    assert {(e["monitor"], e["step"]) for e in verdicts} == {(monitor, step)}
    assert verdicts[0]["extra"]["class"] == cls
    if blamed is not None:
        assert verdicts[0]["extra"]["ranks"] == blamed
    if cls == "data":
        assert verdicts[0]["extra"]["batches"] == [5]
        saved = json.loads((run_dir / "skipped_batches.json").read_text())["batches"]
        assert [b["data_step"] for b in saved] == [5] and len(saved[0]["items"]) == 2
    assert len([e for e in kinds(evs, "rollback") if e["monitor"] == "rollback"]) == 1
    rep = json.loads((run_dir / "replicas.json").read_text())
    assert rep["identical"]  # rank 1's bad update was rolled back on every rank
    assert [x["model_step"] for x in rep["ranks"]] == [12, 12]
    assert len({x["data_step"] for x in rep["ranks"]}) == 1
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert math.isfinite(float(ckpt["stabilize"]["model_step"]))


class PoisonWeight(L.Callback):
    """Sets one weight to NaN just before the forward of a chosen step (a test-only fault
    that makes the forward itself go non-finite, at a known module)."""

    def __init__(self, step, name):
        self.step, self.name = step, name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.train_state.model_step + 1 == self.step and not getattr(self, "done", False):
            self.done = True
            with torch.no_grad():
                dict(pl_module.model.named_parameters())[self.name].view(-1)[3] = float("nan")


def test_nan_in_the_forward_is_localized_to_its_module_and_rolled_back(tmp_path):
    out = run(
        compose_run(tmp_path, [*BASE, "logger=wandb"]),
        callbacks=[PoisonWeight(8, "h.1.mlp.c_fc.weight")],
    )
    (fault,) = [e for e in kinds(events(tmp_path), "rollback") if e["monitor"] == "nonfinite"]
    assert fault["step"] == 8
    (loc,) = fault["extra"]["localization"]
    assert loc["module"] == "h.1.mlp.c_fc" and loc["input_finite"] is True
    assert out["model_step"] == 14
    # the alert reached W&B (read back from the offline run file)
    from stabilize.wandb_offline import find_offline_runs, read_offline_run

    (w,) = find_offline_runs(tmp_path / "wandb")
    alerts = read_offline_run(w, wait_s=30).alerts
    assert any("nonfinite" in a["title"] for a in alerts)
    assert any("rolled back from step 8" in a["text"] for a in alerts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "norm",
    [
        ["norm=rmsnorm", "norm.backend=explicit"],  # row statistics: overflow counts, RMS
        ["norm=layernorm", "norm.placement=post"],  # |x| max only; block hooks (post)
    ],
    ids=["explicit", "torch-post"],
)
def test_monitors_see_the_same_numbers_under_torch_compile(tmp_path, norm):
    common = [*BASE, "trainer.max_steps=3", *norm]
    run(compose_run(tmp_path / "eager", common))
    run(compose_run(tmp_path / "compiled", [*common, "trainer.compile=true"]))
    a, b = read_csv_metrics(tmp_path / "eager"), read_csv_metrics(tmp_path / "compiled")
    keys = ["act/h.0", "act/h.1.ln_1", "attn_logit/h.0.attn"]
    for key in keys + (["rms/h.1.ln_1"] if "norm.backend=explicit" in norm else []):
        va, vb = series(a, key), series(b, key)
        assert va and va.keys() == vb.keys(), key
        for s in va:
            assert vb[s] == pytest.approx(va[s], rel=1e-3), (key, s)


def test_compile_refuses_a_16_bit_reduction_it_would_silently_upcast(tmp_path):
    with pytest.raises(
        ValueError, match="trainer.compile=true is not allowed with norm.reduction_dtype='fp16'"
    ):
        compose_run(tmp_path, ["trainer.compile=true", "norm.reduction_dtype=fp16"])


def test_default_monitor_config_reaches_the_monitors(tmp_path):
    from stabilize.monitors import MonitorSuite

    cfg = compose_run(tmp_path, [])
    suite = MonitorSuite(cfg.monitor)
    assert suite.monitors["grad_spike"].kind == "warn"  # clipping absorbs most spikes
    assert suite.monitors["loss_spike"].kind == "rollback"
    act = suite.monitors["activation"]
    assert (act.horizon, act.forecaster.window, act.forecaster.z) == (40, 8, 3.0)
    cfg2 = compose_run(
        tmp_path, ["monitor.activation.forecast.z=2.5", "monitor.grad_spike.action=rollback"]
    )
    suite2 = MonitorSuite(cfg2.monitor)
    assert suite2.monitors["activation"].forecaster.z == 2.5
    assert suite2.monitors["grad_spike"].kind == "rollback"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["fault=activation_drift", "fault.layer=5"],
            "fault.layer=5 is not allowed with model.n_layer=2",
        ),
        (["fault=activation_drift", "fault.cross_step=120"], "exactly one of them set"),
        (["fault=activation_drift", "fault.target_step=50"], "must be > fault.step=100"),
    ],
)
def test_unsupported_combinations_are_refused(override, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        compose_run(tmp_path, override)


def test_resume_after_a_lower_lr_rollback_continues_like_the_uninterrupted_run(tmp_path):
    """Rollback state across a checkpoint: the remedies, the LR scale, the ladder and the
    fault's firing history are restored, so the resumed run ends where the uninterrupted
    one does (CPU fp32, bit for bit)."""
    common = [
        *BASE,
        "fault=nan_loss",
        "fault.step=5",
        "rollback.ladder=[lower_lr]",
        "trainer.checkpoint_every_n_steps=3",
    ]
    run(compose_run(tmp_path / "full", common))
    run(compose_run(tmp_path / "cut", [*common, "trainer.stop_at_step=9"]))
    out = run(compose_run(tmp_path / "cut", [*common, "resume=auto"]))
    assert out["model_step"] == 14
    assert (
        len([e for e in kinds(events(tmp_path / "cut"), "rollback") if e["monitor"] == "nonfinite"])
        == 1
    )  # the transient fault did not re-fire
    a = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=False)
    assert b["stabilize"]["lr_scale"] == 0.5 and b["stabilize"]["remedies"] == ["lower_lr"]
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_probe_block_and_norm_maxima_match_a_direct_measurement(placement):
    """Whatever tensor the probe reads (its own block hook, or the next norm's input for
    pre-norm, where they are the same tensor), it must equal |x| max measured directly."""
    from stabilize.model import GPT, GPTConfig
    from stabilize.stability.probe import StabilityProbe

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", norm={"placement": placement, "backend": "explicit"}))
    probe = StabilityProbe(model)
    direct = {}
    for i, block in enumerate(model.h):
        block.register_forward_hook(
            lambda m, a, out, i=i: direct.__setitem__(f"h.{i}", out.abs().max().item())
        )
    model.ln_f.register_forward_pre_hook(
        lambda m, a: direct.__setitem__("ln_f", a[0].abs().max().item())
    )
    model.train()
    probe.reset()
    model(torch.randint(0, 256, (2, 32)))
    maxima, counts = probe.vector("cpu")
    named = probe.unpack(maxima.tolist(), counts.tolist())["act_max"]
    for k, v in direct.items():
        assert named[k] == pytest.approx(v, rel=1e-6), k


def test_probe_folds_micro_batches_and_counts_overflowed_rows_like_a_float64_reference():
    """fp16 reductions, half the vocabulary's embeddings blown up so that those tokens'
    rows overflow h.0.ln_1's sum of squares: two forwards (micro-batches) fold into one
    step, maxima by max and counts by +, checked per norm against the norms' captured
    inputs measured in float64 here. Then reset, the attention hooks only on detailed
    steps, and remove() leaving the model as it was."""
    from stabilize.model import GPT, GPTConfig
    from stabilize.norms import Norm
    from stabilize.stability.probe import StabilityProbe

    torch.manual_seed(0)
    cfg = GPTConfig.preset(
        "tiny", norm={"type": "rmsnorm", "backend": "explicit", "reduction_dtype": "fp16"}
    )
    model = GPT(cfg).train()
    with torch.no_grad():
        model.wte.weight[:128] *= 2000  # RMS ~40: sum of 128 squares ~2e5 > 65504
    probe = StabilityProbe(model)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, Norm)}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in norms}
    for n, m in norms.items():
        m.register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].detach().double()))
    buf = None
    for detailed in (True, False):
        probe.reset(detailed=detailed, device="cpu")
        buf = buf if buf is not None else probe.buf
        assert probe.buf is buf  # reused, not reallocated
        assert bool(model.h[0].attn.q_norm._forward_hooks) == detailed
        for v in seen.values():
            v.clear()
        for _ in range(2):  # two micro-batches of one optimizer step
            model(torch.randint(0, 256, (4, 32)))
        maxima, counts = probe.vector("cpu")
        got = probe.unpack(maxima.tolist(), counts.tolist())
        total_over = 0
        for n, xs in seen.items():
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])  # both micro-batches
            ss = x.half().double().square().sum(-1)  # the fp16 rows, summed exactly
            assert ((ss - 65520).abs() > 0.05 * 65520).all()  # no borderline row
            over = int((ss >= 65520).sum())  # fp16 rounds sums from 65520 up to inf
            total_over += over
            assert got["act_max"][n] == pytest.approx(x.abs().max().item(), rel=1e-6), n
            assert got["norm_overflow"][n] == over, n
            assert got["norm_collapsed"][n] == over, n  # every input row was finite
            rms = math.inf if over else math.sqrt((ss.max() / x.shape[-1]).item() + 1e-5)
            assert got["norm_rms_max"][n] == pytest.approx(rms, rel=2e-3), n
        assert total_over > 0 and got["norm_overflow"]["h.0.ln_1"] < 2 * 4 * 32
        # measured on detailed steps only; on the others absent, never a 0
        assert bool(got["attn_logit"]) == detailed
        assert all(v > 0 for v in got["attn_logit"].values())
    probe.reset(detailed=False, device=torch.device("cpu"))
    assert probe.buf is buf and probe.vector("cpu")[1].abs().sum() == 0
    probe.remove()
    assert all(m.stats_sink is None for m in norms.values())
    assert not model.h[0].attn.q_norm._forward_hooks and not model.h[0]._forward_hooks


def _bare_stability(tmp_path, **rollback):
    """The stability engine on a two-layer model with a real AdamW and scheduler, in a plain
    loop's ``Loop`` (guard.py), just enough for ``snapshot``/``restore``; ``train(n)`` takes
    n real steps."""
    from types import SimpleNamespace

    from stabilize.faults import FaultConfig
    from stabilize.guard import GuardLoop
    from stabilize.monitors import MonitorConfig
    from stabilize.rollback import RollbackConfig
    from stabilize.stability.engine import StabilityEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cb = StabilityEngine(MonitorConfig(), RollbackConfig(**rollback), FaultConfig(), tmp_path)
    pl = SimpleNamespace(model=model, train_state=TrainState(model))
    cb.loop, cb.host = GuardLoop(opt, None, [sched], tmp_path, 10), pl
    trainer = None

    def train(n):
        for _ in range(n):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            pl.train_state.model_step += 1

    return cb, trainer, pl, opt, train


def _frozen(state):  # an independent copy of a snapshot's tensors
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in state["optimizer"]["state"].items()
        },
    }


def _assert_state_equal(state, ref):
    for k, v in ref["model"].items():
        assert torch.equal(state["model"][k], v), k
    for i, s in ref["optimizer"].items():
        for k, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][k], v), (i, k)


def test_snapshots_reuse_their_buffers_and_a_restore_never_aliases_one(tmp_path):
    """The ring writes a new snapshot into the buffers of the one leaving it; a restore
    must hand the optimizer copies (Optimizer.load_state_dict keeps a CPU snapshot's own
    tensors), or training would rewrite the snapshot and a second rollback to it would
    restore the live state."""
    cb, trainer, pl, opt, train = _bare_stability(tmp_path, keep=2, durable_every=0)
    model = pl.model
    frozen, assert_equal = _frozen, _assert_state_equal
    snaps = []
    for _ in range(3):
        train(1)
        cb.snapshot()
        snaps.append(cb.ring.ring[-1])
    a, b, c = snaps
    assert cb.ring.steps() == [2, 3]
    # c was written into a's buffers (a left the ring), and holds the live state
    assert c.state["model"]["0.weight"] is a.state["model"]["0.weight"]
    assert (
        c.state["optimizer"]["state"][0]["exp_avg"] is a.state["optimizer"]["state"][0]["exp_avg"]
    )
    assert torch.equal(c.state["model"]["0.weight"], model[0].weight)
    assert torch.equal(
        c.state["optimizer"]["state"][0]["exp_avg"], opt.state[model[0].weight]["exp_avg"]
    )
    ref = frozen(b.state)
    for _ in range(2):  # two rollbacks to the same snapshot, training in between
        cb.restore(b.state)
        assert torch.equal(opt.state[model[0].weight]["exp_avg"], ref["optimizer"][0]["exp_avg"])
        assert torch.equal(model[0].weight, ref["model"]["0.weight"])
        train(2)
        assert_equal(b.state, ref)  # untouched by the training after the restore
    # a rollback drops the newer snapshots; their buffers serve the next one
    cb.ring.drop_after(b.step)
    assert cb.ring.steps() == [2]
    cb.snapshot()
    assert cb.ring.ring[-1].state["model"]["0.weight"] is c.state["model"]["0.weight"]
    assert_equal(b.state, ref)


def test_durable_writes_run_in_the_background_and_never_see_a_recycled_buffer(
    tmp_path, monkeypatch
):
    """keep=1, a durable write on every snapshot: the next snapshot recycles the very
    buffers being written. The write is slowed (the real save_durable after a pause), so
    without the wait in ``_snapshot`` the file would hold the next step's weights."""
    import threading

    import stabilize.rollback.snapshots as rb

    real, threads = rb.save_durable, set()

    def slow_save(snap, directory):
        threads.add(threading.current_thread().name)
        time.sleep(0.3)
        return real(snap, directory)

    monkeypatch.setattr(rb, "save_durable", slow_save)
    cb, trainer, pl, _opt, train = _bare_stability(tmp_path, keep=1, durable_every=1)
    refs, took = {}, {}
    for _ in range(3):
        train(1)
        t = time.perf_counter()
        cb.snapshot()
        took[pl.train_state.model_step] = time.perf_counter() - t
        refs[pl.train_state.model_step] = _frozen(cb.ring.ring[-1].state)
    assert took[1] < 0.25  # the first write did not block training
    cb.writer.close()  # waits for the last write
    assert threads and all(n.startswith("stabilize-durable") for n in threads)
    files = sorted((tmp_path / "snapshots").glob("snapshot-*.pt"))
    assert [f.name for f in files] == [f"snapshot-{i:06d}.pt" for i in (1, 2, 3)]
    for f in files:
        snap = load_durable(f)
        _assert_state_equal(snap.state, refs[snap.step])
    # snapshots 2 and 3 waited for the (0.3 s) write before them: it held their buffers
    assert took[2] >= 0.15 and took[3] >= 0.15, took


def test_a_failed_durable_write_is_raised_on_the_training_thread(tmp_path):
    cb, trainer, pl, _opt, train = _bare_stability(tmp_path, keep=2, durable_every=1)
    (tmp_path / "snapshots").write_text("a file where the directory should be")
    train(1)
    cb.snapshot()  # submitted; it fails on the writer thread
    with pytest.raises((FileExistsError, NotADirectoryError)):
        cb.writer.wait()
    cb.writer.close()


def test_durable_async_false_writes_in_line(tmp_path):
    cb, trainer, pl, _opt, train = _bare_stability(
        tmp_path, keep=2, durable_every=1, durable_async=False
    )
    train(1)
    cb.snapshot()  # returns after the file is on disk, no thread involved
    assert cb.writer._pool is None
    snap = load_durable(tmp_path / "snapshots" / "snapshot-000001.pt")
    _assert_state_equal(snap.state, _frozen(cb.ring.ring[-1].state))
