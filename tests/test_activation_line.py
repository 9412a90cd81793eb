"""The 256 line follows the run's precision and reduction dtype.

256 is a danger only where an fp16 square is taken (256^2 > 65504): a real tiny run whose
block 0 drifts past 256 on CROSS warns there with an fp16-mixed + fp16 reduction, and logs
an INFO (no WARN) in fp32; ``monitor.activation.line=fp16_square`` forces the WARN back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stabilize.monitors.activations import ActivationConfig, ActivationMonitor, resolve_line
from stabilize.monitors.events import StepStats
from stabilize.monitors.forecast import ForecastConfig
from stabilize.train import run
from stabilize.validate import ConfigError

from conftest import FAST, compose_run

CROSS = 9
DRIFT = [
    *FAST,
    "logger=none",
    "trainer.max_steps=11",
    "trainer.val_check_interval=100",
    "trainer.checkpoint_every_n_steps=100",
    "rollback=off",
    "monitor.grad_spike.enabled=false",
    "monitor.loss_spike.enabled=false",
    "fault=activation_drift",
    "fault.step=3",
    "fault.target_step=null",
    f"fault.cross_step={CROSS}",
    "fault.channels=1",
    "norm=rmsnorm",
    "model.init_std=0.1",  # the fp16 reduction's backward trains at this width (test_stability)
]


def crossings(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "events.jsonl").read_text().splitlines()
    evs = [json.loads(line) for line in lines]
    # h.0's output is h.1.ln_1's input: one tensor, judged as the norm that reads it
    return [e for e in evs if e["monitor"] == "activation" and e["layer"] == "h.1.ln_1"]


def test_fp32_run_past_256_logs_info_not_a_warning(tmp_path):
    run(compose_run(tmp_path, [*DRIFT, "precision=fp32", "norm.reduction_dtype=fp32"]))
    (crossed,) = crossings(tmp_path)
    assert crossed["step"] == CROSS and crossed["value"] > 256
    assert crossed["kind"] == "info"  # no fp16 square in this run: not a danger
    assert "no fp16 square" in crossed["message"] and "fp32's range" in crossed["message"]


def test_fp16_reduction_warns_at_the_crossing_as_the_fp16_square_overflow(tmp_path):
    overrides = [*DRIFT, "precision=fp16-mixed", "norm.reduction_dtype=fp16"]
    run(compose_run(tmp_path, overrides))
    warned = [e for e in crossings(tmp_path) if e["kind"] == "warn"]
    assert warned and warned[0]["step"] == CROSS
    assert "an fp16 square overflows past 255.94" in warned[0]["message"]


def test_forced_line_warns_in_fp32(tmp_path):
    run(compose_run(tmp_path, [*DRIFT, "precision=fp32", "monitor.activation.line=fp16_square"]))
    (crossed,) = crossings(tmp_path)
    assert (crossed["kind"], crossed["step"]) == ("warn", CROSS)


@pytest.mark.parametrize(
    "precision, reduction, line, dtype",
    [
        ("fp32", "fp32", "info", "fp32"),
        ("fp32", "fp16", "fp16_square", "fp32"),  # the norm casts to fp16 to reduce
        ("fp16-mixed", "fp16", "fp16_square", "fp16"),
        ("fp16-mixed", "input", "fp16_square", "fp16"),
        ("fp16-mixed", "fp32", "info", "fp16"),
        ("bf16-mixed", "bf16", "info", "bf16"),
        ("bf16-true", "input", "info", "bf16"),
    ],
)
def test_auto_resolves_from_precision_and_reduction(precision, reduction, line, dtype):
    c = resolve_line(ActivationConfig(), precision, reduction)
    assert (c.line, c.activation_dtype) == (line, dtype)
    # a setting other than auto is the user's and is kept
    assert resolve_line(ActivationConfig(line="off"), precision, reduction).line == "off"


def test_fp16_activations_with_a_wide_reduction_name_the_cast_line():
    """fp16-mixed with an fp32 reduction: the norm is safe, the cast to fp16 at 65504 is the
    line that matters; the INFO says so. ``off`` and ``info`` say nothing of a forecast: no
    16-bit reduction can overflow there, so the forecast does not even run."""
    c = resolve_line(ActivationConfig(), "fp16-mixed", "fp32")
    mon = ActivationMonitor.from_config("activation", c)
    (e,) = mon.update(StepStats(step=1, loss=1.0, act_max={"h.0": 300.0}))
    assert e.kind == "info" and "65504" in e.message
    fast = ForecastConfig(window=4, start=4)
    for line in ("off", "info"):
        quiet = ActivationMonitor(ActivationConfig(line=line, forecast=fast))
        evs = [
            quiet.update(StepStats(step=s, loss=1.0, act_max={"h.0": 2.0**s})) for s in range(1, 8)
        ]
        assert not [e for es in evs for e in es if e.monitor == "forecast"] and not quiet.forecast
    loud = ActivationMonitor(ActivationConfig(line="fp16_square", forecast=fast))
    evs = [loud.update(StepStats(step=s, loss=1.0, act_max={"h.0": 2.0**s})) for s in range(1, 8)]
    # step 4 (16): 8x climbed, 16x left (forecast.climb 1 holds it); step 5 (32): 16x, 8x left
    assert [e.step for es in evs for e in es if e.monitor == "forecast"] == [5]


def test_bad_line_is_refused_with_the_allowed_values(tmp_path):
    with pytest.raises(ConfigError, match=r"monitor.activation.line='fp16'.*'fp16_square'"):
        compose_run(tmp_path, ["monitor.activation.line=fp16"])
