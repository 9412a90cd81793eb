"""A model converted with torchao's ``convert_to_float8_training`` (emulated on CPU) trains
under each of the three adapters (tests/adapters_common.py), and the probe's headroom series
of every quantized GEMM operand (fprop's input and weight, dgrad's grad-output) are in the
run's metrics.csv, step by step equal to an independent float64 computation on the same
tensors: the scale torchao's tensorwise recipe takes (the format's max over the tensor's
amax), torch's own saturating fp8 cast, and the SQNR of the dequantized tensor."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao")

from adapters_common import ADAPTERS, run  # noqa: E402

STEPS = 3
FP8 = {
    "x": (torch.float8_e4m3fn, 448.0),
    "w": (torch.float8_e4m3fn, 448.0),
    "dy": (torch.float8_e5m2, 57344.0),
}  # fmt: skip  (torchao's tensorwise recipe)


def _reference(t: torch.Tensor, op: str) -> dict[str, float]:
    """Tensorwise current scaling, in float64 where it is arithmetic; the cast is torch's."""
    dtype, top = FP8[op]
    x = t.detach().double()
    amax = x.abs().max().clamp(min=1e-12)
    scale = (top / amax.float()).double()  # torchao computes the scale in fp32
    scaled = x * scale
    q = scaled.float().to(dtype).double()
    deq = q / scale
    nonzero = x != 0
    err = (x - deq).norm()
    return {
        "amax": float(amax),
        "amax_ratio": float(scaled.abs().max() / top),
        "saturated": 0.0,  # the scale maps the amax onto the format's max
        "underflow": float((nonzero & (q == 0)).double().mean()),
        "sqnr_db": float(20 * torch.log10(x.norm() / err)) if err > 0 else 1e9,
    }


def _convert_and_watch(seen: list[dict[str, dict[str, float]]]):
    """Convert every Linear but the head; keep each training forward's reference values."""

    def plant(model):
        from stabilize.quant.ao import convert_float8

        names = convert_float8(model, "tensorwise")
        assert names and "lm_head" not in names
        order = [n for n, _ in model.named_modules() if n in set(names)]  # forward order
        first = model.get_submodule(order[0])
        for name in names:
            m = model.get_submodule(name)

            def pre(module, args, name=name):
                if not module.training:
                    return
                if module is first:
                    seen.append({})
                seen[-1][f"{name}.x"] = _reference(args[0], "x")
                seen[-1][f"{name}.w"] = _reference(module.weight, "w")

            def post(module, args, out, name=name):
                if module.training:
                    step = seen[-1]
                    out.register_hook(lambda g: step.update({f"{name}.dy": _reference(g, "dy")}))

            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)

    return plant


PREFIX = {"amax": "q_amax", "amax_ratio": "q_ratio", "saturated": "q_sat",
          "underflow": "q_under", "sqnr_db": "q_sqnr"}  # fmt: skip


def _logged(run_dir: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("train/step") and any(k.startswith("q_") and v for k, v in row.items()):
                vals = {k: float(v) for k, v in row.items() if k.startswith("q_") and v}
                out.setdefault(int(float(row["train/step"])), {}).update(vals)
    return out


@pytest.mark.parametrize("kind", ADAPTERS)
def test_float8_headroom_series_equal_a_float64_computation(kind, tmp_path):
    seen: list[dict[str, dict[str, float]]] = []
    r = run(kind, tmp_path, STEPS, hook=_convert_and_watch(seen), rollback={"enabled": False})
    assert r.model_step == STEPS and len(seen) == STEPS
    logged = _logged(tmp_path)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, ref in enumerate(seen, 1):
        assert len(ref) == 3 * 14  # 2 blocks x 7 Linears (q, k, v, o, gate, up, down), 3 operands
        for operand, want in ref.items():
            for metric, prefix in PREFIX.items():
                got = logged[step][f"{prefix}/{operand}"]
                assert math.isclose(got, want[metric], rel_tol=1e-5, abs_tol=1e-7), (
                    step, operand, metric, got, want[metric])  # fmt: skip
    # an 8-bit gradient's SQNR is far below an 8-bit activation's (E5M2: 2 mantissa bits)
    last = seen[-1]
    assert all(last[k]["sqnr_db"] < last[k.replace(".dy", ".x")]["sqnr_db"]
               for k in last if k.endswith(".dy"))  # fmt: skip
