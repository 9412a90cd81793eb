"""``monitor.quant`` (stabilize/monitors/quant.py) and the quant rungs
(stabilize/rollback/quant_remedies.py): a saturating operand is a verdict naming its layer,
a flushed one a warning, a climbing amax ratio is forecast ahead of the format's max; each
rung changes what it says or says why it would not; and on a real plain-loop run a
saturating delayed-scaling GEMM is rolled back and answered by a wider margin, after which
nothing saturates."""

from __future__ import annotations

import json
import math

import torch

import stabilize
from stabilize.monitors import StepStats
from stabilize.monitors.quant import QuantMonitor, QuantMonitorConfig
from stabilize.quant.linear import QuantLinear, swap_linears
from stabilize.rollback.remedies import get_remedy
from stabilize.rollback.state import TrainState


def _stats(step: int, **series) -> StepStats:
    return StepStats(step=step, loss=1.0, grad_norm=1.0, **series)


def test_saturation_is_one_verdict_per_episode_naming_its_layer():
    m = QuantMonitor(QuantMonitorConfig(on_saturation="rollback"))
    ev = m.update(_stats(1, quant_saturated={"h.0.mlp.c_fc.x": 0.002, "h.0.mlp.c_fc.w": 0.0}))
    assert [(e.kind, e.layer, e.extra["site"]) for e in ev] == [
        ("rollback", "h.0.mlp.c_fc.x", "h.0.mlp.c_fc")
    ]
    assert "0.200% of its elements saturated" in ev[0].message
    assert m.update(_stats(2, quant_saturated={"h.0.mlp.c_fc.x": 0.003})) == []  # same episode
    m.update(_stats(3, quant_saturated={"h.0.mlp.c_fc.x": 0.0}))  # over
    assert len(m.update(_stats(4, quant_saturated={"h.0.mlp.c_fc.x": 0.01}))) == 1
    flushed = m.update(_stats(5, quant_underflow={"h.1.attn.c_proj.dy": 0.2}))
    assert [(e.kind, e.monitor) for e in flushed] == [("warn", "quant")]


def test_an_accelerating_amax_ratio_is_forecast_ten_steps_or_more_ahead():
    """A delayed-scaling operand whose growth per step itself grows: its amax ratio (the
    step's amax over its history's) climbs to its saturation edge (E4M3's 464 / 448) at
    step 40, computed here; the monitor warns at least 10 steps before. An operand with no
    edge (current scaling: its ratio follows the tensor) is never forecast, and with the
    forecast off (the default) nothing is."""
    m = QuantMonitor(QuantMonitorConfig(forecast=True, horizon=50, window=8))
    edge = 464 / 448
    ratio = {t: 0.3 * math.exp(math.log(edge / 0.3) * t / 40) for t in range(1, 60)}
    reach = next(t for t, r in ratio.items() if r >= edge)
    warned = None
    for t in range(1, reach):
        ratios = {"h.0.mlp.c_proj.x": ratio[t], "cur.x": 0.9 + 0.002 * t}
        ev = m.update(_stats(t, quant_amax_ratio=ratios, quant_edge={"h.0.mlp.c_proj.x": edge}))
        if ev and warned is None:
            warned = t
            assert ev[0].layer == "h.0.mlp.c_proj.x" and "where its cast saturates" in ev[0].message
    assert warned is not None and reach - warned >= 10, (warned, reach)
    assert "cur.x" not in m.forecast
    off = QuantMonitor(QuantMonitorConfig())
    climbing = [_stats(t, quant_amax_ratio={"a.x": ratio[t]}, quant_edge={"a.x": edge})
                for t in range(1, reach)]  # fmt: skip
    assert [e for s in climbing for e in off.update(s)] == [] and off.forecast == {}


def _model(recipe: str, **knobs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    swap_linears(model, ["0", "2"], recipe, **knobs)
    return model


def test_each_rung_changes_what_it_names_or_says_why_not():
    delayed, floor = _model("fp8_delayed"), _model("mxfp8", scale_rounding="floor")
    ts, tf = TrainState(delayed), TrainState(floor)
    for rung in ("quant_margin", "quant_current"):
        assert get_remedy(rung).unchanged(ts, None) is None
        assert get_remedy(rung).unchanged(tf, None) == "no Linear uses delayed scaling"
    assert get_remedy("quant_rceil").unchanged(ts, None) is not None
    get_remedy("quant_margin").apply(ts, None)
    assert [m.margin for m in delayed.modules() if isinstance(m, QuantLinear)] == [1, 1]
    get_remedy("quant_rceil").apply(tf, None)
    assert {m.schemes[0].scale_rounding for m in floor.modules() if isinstance(m, QuantLinear)} == {
        "rceil"
    }
    get_remedy("quant_current").apply(ts, None)
    assert {m.schemes[0].kind for m in delayed.modules() if isinstance(m, QuantLinear)} == {
        "tensor"
    }
    assert get_remedy("quant_current").unchanged(ts, None) == "no Linear uses delayed scaling"
    bf16 = get_remedy("quant_bf16")
    assert bf16.unchanged(ts, None) is not None  # no layer named by a verdict
    ts.fault_sites = ["2"]
    assert bf16.apply(ts, None) == {"high_precision": ["2"]} and delayed[2].high_precision
    x = torch.randn(4, 64)
    assert torch.equal(
        delayed[2](x), torch.nn.functional.linear(x, delayed[2].weight, delayed[2].bias)
    )
    # after a checkpoint load the attributes come back from the saved names and counts
    fresh = _model("fp8_delayed")
    tfresh = TrainState(fresh)
    tfresh.high_precision = ["2"]
    for rung, times in (("quant_margin", 2), ("quant_bf16", 1)):
        get_remedy(rung).reapply(tfresh, None, times)
    assert fresh[0].margin == 2 and fresh[2].high_precision


def _loss(model, batch):
    return (model(batch) - batch).square().mean()


def test_a_saturating_delayed_gemm_is_rolled_back_and_a_wider_margin_ends_it(tmp_path):
    """Inputs growing 30% a step under fp8_delayed (history 4): from step 2 the scale is a
    step behind and elements saturate; the verdict rolls back and the first rung, one more
    power of two of margin (the scale then holds 2x growth, taken again from the history at
    once), ends it: no saturation after."""
    model = _model("fp8_delayed", history=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(
        model, opt, run_dir=tmp_path, loss_fn=_loss, log_every=1,
        # the inputs' own growth lifts the loss 30% a step: the spike monitors are not asked
        monitor={"quant": {"on_saturation": "rollback"}, "loss_spike": {"enabled": False},
                 "grad_spike": {"enabled": False}},
        rollback={"classify": False, "ladder": ["quant_margin", "quant_current"],
                  "snapshot_every": 1},
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(16, 64, generator=g) * 1.3**k for k in range(10)]
    verdicts = []
    for x in guard.batches(data):
        loss = _loss(model, x)
        loss.backward()
        v = guard.before_step(loss)
        verdicts.append(v)
        if v.apply:
            opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    rolled = [e for e in events if e["monitor"] == "rollback"]
    assert [e["extra"]["remedy"] for e in rolled] == ["quant_margin"], rolled
    first = rolled[0]["step"]
    after = [e for e in events if e["monitor"] == "quant" and e["step"] > first]
    assert not [e for e in after if "saturated" in e["message"]], after  # the margin holds it
    # what a wider margin costs: the smallest values of the GELU's output flush to 0 (the
    # underflow warning says so; the margin trades clipping at the top for it at the bottom)
    assert all("flushed to 0" in e["message"] for e in after)
    assert [m.margin for m in model.modules() if isinstance(m, QuantLinear)] == [1, 1]
    assert sum(not v.apply for v in verdicts) == 1


def test_between_log_steps_a_clipping_group_is_seen_off_the_casts_group_maxima(tmp_path):
    """Log steps every 5: at step 2 (not a log step) the delayed scale is a step behind the
    30% growth; the monitor sees it from the cast's group maxima alone (its tensor's one
    group clipped), and on the log step 5 from the element share."""
    model = _model("fp8_delayed", history=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = stabilize.Guard(model, opt, run_dir=tmp_path, loss_fn=_loss, log_every=5,
                            monitor={"loss_spike": {"enabled": False},
                                     "grad_spike": {"enabled": False}},
                            rollback={"enabled": False})  # fmt: skip
    g = torch.Generator().manual_seed(1)
    seen = []
    for x in guard.batches([torch.randn(16, 64, generator=g) * 1.3**k for k in range(5)]):
        loss = _loss(model, x)
        loss.backward()
        v = guard.before_step(loss)
        seen.append((dict(guard.last.quant_saturated), dict(guard.last.quant_clipped)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    guard.close()
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    first = next(e for e in events if e["monitor"] == "quant" and e["layer"] == "0.x")
    assert first["step"] == 2 and "of its scale groups clipped" in first["message"]
    sat2, clip2 = seen[1]
    assert "0.x" not in sat2 and clip2["0.x"] == 1.0  # one group (the tensor), clipped
    sat5, _ = seen[4]
    assert sat5["0.x"] > 0  # the log step counts the elements
    assert v.step == 5


def _saturating_steps(factors: list[float], history: int = 16) -> list[int]:
    """Steps (from 1) at which a tensor whose amax is 1 x f(t) saturates E4M3 under delayed
    scaling (margin 0, history max), by the real DelayedScaling and the format's own edge."""
    from stabilize.quant.formats import E4M3, overflows
    from stabilize.quant.scaling import DelayedScaling

    ds = DelayedScaling(E4M3, history=history)
    ds.update(torch.tensor(1.0))  # a stable past: the scale follows amax 1
    out = []
    for t, f in enumerate(factors, start=1):
        a = torch.tensor(f)
        if overflows(a * ds.scale, E4M3):
            out.append(t)
        ds.update(a)
    return out


def test_under_a_history_max_a_linear_ramp_saturates_on_its_first_steps_or_never():
    """Why the forecast is scored on a growth whose step ratio rises: amax 1 + 0.045 t has
    ratio a_t / a_(t-1) = 1 + 0.045 / (1 + 0.045 (t - 1)), above 464 / 448 (the value E4M3's
    max rounds from) up to t = 6 and below it after, by hand; 1 + 0.02 t never passes it.
    A step ratio rising by 0.004 a step from 1 passes it at k = 9, the tenth step."""
    linear = [1 + 0.045 * t for t in range(1, 80)]
    by_hand = [t for t in range(1, 80) if 1 + 0.045 / (1 + 0.045 * (t - 1)) > 464 / 448]
    assert _saturating_steps(linear) == by_hand == list(range(1, 7))
    assert _saturating_steps([1 + 0.02 * t for t in range(1, 80)]) == []
    f, rising = 1.0, []
    for k in range(40):
        f *= 1 + 0.004 * k
        rising.append(f)
    assert _saturating_steps(rising)[0] == 10 and _saturating_steps(rising) == list(range(10, 41))
