"""Issue 36: a deep model's per-layer panels in W&B (stability/wandb_layers.py). A prefix
with more keys than ``layer_panels`` is hidden from W&B's automatic panels (a
``define_metric`` record in the run itself) and drawn at the end as one chart, every key a
line; the chart's table holds the values the CSVLogger wrote for the same steps (the
independent record), thinned as stated. Real offline W&B files, a real Trainer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch

import stabilize

pytest.importorskip("transformers")

from your_lm import GPT2LM, loader  # noqa: E402

from stabilize.stability.wandb_layers import layer_order  # noqa: E402
from stabilize.wandb_offline import find_offline_runs, read_offline_run  # noqa: E402

STEPS = 6


def _csv(path: Path) -> dict[str, dict[int, float]]:
    """Each column of a CSVLogger's metrics.csv by step."""
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None) and k != "step":
                    out.setdefault(k, {})[int(row["step"])] = float(v)
    return out


def test_a_deep_models_layers_are_hidden_from_auto_panels_and_drawn_one_chart_each(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    torch.manual_seed(0)
    wandb = WandbLogger(save_dir=tmp_path, mode="offline", project="mine", anonymous=None)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    cb = stabilize.StabilityCallback()  # layer_panels=24: 13 blocks give act/ 40 keys
    cb.engine.sink.layers.points = 2  # the thinning, by hand below
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", log_every_n_steps=1,
                        logger=[csv_logger, wandb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(GPT2LM(n_layer=13, n_embd=16, n_head=2), loader())
    wandb.experiment.finish()
    (offline,) = find_offline_runs(tmp_path / "wandb")
    run = read_offline_run(offline, wait_s=30)
    cols = _csv(Path(csv_logger.log_dir) / "metrics.csv")
    by_prefix: dict[str, list[str]] = {}
    for k in cols:
        by_prefix.setdefault(k.partition("/")[0], []).append(k)
    hidden = {m["name"] for m in run.metrics if m["hidden"]}
    # hidden exactly where a prefix has more than 24 keys; the step's scalars never
    want = {f"{p}/*" for p, ks in by_prefix.items() if len(ks) > 24 and p not in ("train",)}
    assert "act/*" in want and hidden == want, (hidden, want)
    # the act chart: its table's points are the CSV's values at the kept steps
    (row,) = [r for r in run.history if "layers/act_table/path" in r]
    table = json.loads((offline / "files" / row["layers/act_table/path"]).read_text())
    assert table["columns"][:3] == ["step", "lineKey", "lineVal"]
    # 6 log steps, at most 2 points: kept at the 3rd (thinned to log steps 0, 2, stride 2),
    # at the 5th (0, 2, 4 -> 0, 4, stride 4): log steps 0 and 4 remain
    act = sorted(by_prefix["act"], key=layer_order)
    steps = sorted(cols[act[0]])
    assert len(steps) == STEPS
    lines: dict[str, list[tuple[int, float]]] = {}
    for step, key, val in table["data"]:
        lines.setdefault(key, []).append((step, val))
    assert list(lines) == [k.partition("/")[2] for k in act]  # the model's order: h.2 < h.10
    assert list(lines).index("transformer.h.2") < list(lines).index("transformer.h.10")
    for k in act:
        got = lines[k.partition("/")[2]]
        assert [s for s, _ in got] == [steps[0], steps[4]], got
        for s, v in got:
            assert v == pytest.approx(cols[k][s], rel=1e-6)


@pytest.mark.parametrize("bad", [-2, "24", 2.5, True])
def test_a_bad_layer_panels_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"layer_panels=.* is not allowed; must be an integer"):
        stabilize.StabilityCallback(layer_panels=bad)


def test_the_dashboards_get_the_log_steps_and_the_local_csv_every_step(tmp_path):
    """The step's scalars go to the CSVLogger every step and to W&B on the log steps
    (Lightning's own ``self.log`` keeps to ``log_every_n_steps``): a real offline W&B file
    against the CSV beside it."""
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    torch.manual_seed(0)
    every, steps = 3, 9
    wandb = WandbLogger(save_dir=tmp_path, mode="offline", project="mine", anonymous=None)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", log_every_n_steps=every,
                        logger=[csv_logger, wandb], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[stabilize.StabilityCallback()],
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(GPT2LM(n_layer=2, n_embd=16, n_head=2), loader())
    wandb.experiment.finish()
    (offline,) = find_offline_runs(tmp_path / "wandb")
    run = read_offline_run(offline, wait_s=30)
    local = sorted(_csv(Path(csv_logger.log_dir) / "metrics.csv")["train/step"].values())
    assert len(local) == len(set(local)) == steps  # every step
    remote = [int(v) for v in run.series("train/step")]
    assert remote and set(remote) < set(local) and remote == sorted(remote)
    # the per-layer series ride on the same log steps: each W&B row with a step has them
    rows = [r for r in run.history if "train/step" in r]
    assert all(any(k.startswith("act/") for k in r) for r in rows)
    assert len(remote) == steps // every
