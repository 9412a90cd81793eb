"""The activation drift, unit by unit: its factor is solved inside the forward so the block's
|x| max is exactly on the planned path, whose rate comes from the step it must cross on."""

from __future__ import annotations

import math

import pytest
import torch

from stabilize.faults import FaultConfig, FaultInjector, fault_config
from stabilize.model import GPT, GPTConfig


def drifted(cfg: FaultConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.preset("tiny", block_size=32))
    inj = FaultInjector(cfg)
    inj.attach(model)
    seen = {}
    model.h[cfg.layer].register_forward_hook(lambda m, a, o: seen.update(out=o.detach()))
    x = torch.randint(0, 256, (4, 32))
    return model, inj, seen, x


def test_solver_hits_the_target_whatever_the_input():
    torch.manual_seed(1)
    for _ in range(20):
        x, u = torch.randn(64, 16) * 3, torch.randn(64, 16)
        target = float(torch.empty(()).uniform_(30, 1e5))
        f = FaultInjector._solve(x, u, target)
        assert float((x + f * u).abs().max()) == pytest.approx(target, rel=1e-5)


def test_drift_pins_the_max_on_a_path_that_crosses_256_on_the_chosen_step():
    cfg = fault_config(kind="activation_drift", step=3, target_step=None, cross_step=9, target=1e5)
    model, inj, seen, x = drifted(cfg)
    maxima = {}
    for step in range(1, 16):
        inj.begin(step)
        with torch.no_grad():
            model(x)
        maxima[step] = float(seen["out"].abs().max())
    a0 = maxima[3]
    rate = math.log(256 / a0) / (9 - 0.5 - 3)  # derived from the crossing step
    for step in range(3, 16):  # geometric from the natural level, then holding at the target
        want = min(a0 * math.exp(rate * (step - 3)), 1e5)
        assert maxima[step] == pytest.approx(want, rel=1e-4), step
    assert maxima[8] < 256 < maxima[9]
    assert maxima[1] == pytest.approx(maxima[2], rel=0.05)  # untouched before the start


def test_outlier_drift_touches_only_its_channels():
    cfg = fault_config(kind="activation_drift", step=1, target_step=5, target=1e3, channels=1)
    model, inj, seen, x = drifted(cfg)
    inj.begin(1)
    with torch.no_grad():
        model(x)
    natural = seen["out"].clone()
    inj.begin(5)
    with torch.no_grad():
        model(x)
    out = seen["out"]
    assert float(out[..., 0].abs().max()) == pytest.approx(1e3, rel=1e-4)
    torch.testing.assert_close(out[..., 1:], natural[..., 1:])  # other channels as they were


def test_transient_and_persistent_drift_after_a_rollback():
    for persistent, expect_disabled in ((False, True), (True, False)):
        cfg = fault_config(
            kind="activation_drift", step=2, target_step=6, target=500.0, persistent=persistent
        )
        model, inj, _, x = drifted(cfg)
        before = inj.snapshot_state()
        for step in (1, 2, 3):
            inj.begin(step)
            with torch.no_grad():
                model(x)
        inj.on_rollback(before)
        assert inj.disabled is expect_disabled


def test_a_cross_line_below_the_natural_level_is_a_clear_error():
    cfg = fault_config(kind="activation_drift", step=1, target_step=None, cross_step=5, cross=1e-3)
    model, inj, _, x = drifted(cfg)
    inj.begin(1)
    with pytest.raises(ValueError, match=r"fault.cross=0.001 is not allowed: block 0's \|x\| max"):
        model(x)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"target_step": None}, "exactly one of them set"),
        ({"cross_step": 200}, "exactly one of them set"),
        (
            {"target_step": None, "cross_step": 50},
            "fault.cross_step=50 is not allowed; must be > fault.step=100",
        ),
        ({"target_step": None, "cross_step": 150, "cross": 2e4}, "must be < fault.target=10000"),
        ({"channels": 0}, "fault.channels"),
    ],
)
def test_invalid_drift_settings_name_the_key(kw, message):
    with pytest.raises(ValueError, match=message):
        fault_config(kind="activation_drift", step=100, **kw)
