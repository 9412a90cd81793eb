"""``stabilize-map`` (stabilize/map/): a 2 x 2 x 1 map runs end to end through Hydra's
multirun and the joblib launcher, a high LR without qk-norm is marked diverged with its
mechanism, a relaunch skips finished cells, W&B offline files hold the group and a table,
submitit's local executor runs a cell; the LR
sensitivity, the best LR and the verdicts are checked by hand.

The references: the cells' own metrics.csv (the final loss recomputed here), ln(256) (the
loss of a byte model at initialization, which predicts ~uniformly), hand calculations.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math

import pytest

from stabilize.map.analysis import refine_best, sensitivity
from stabilize.map.claims import ratio_verdict, spearman
from stabilize.wandb_offline import find_offline_runs, read_offline_run

from conftest import run_cli

SPEC = """name: t
recipes:
  layernorm: [norm=layernorm]
  layernorm-qknorm: [norm=layernorm, norm.qk_norm=true]
lr: {min: 1.0e-3, max: 1.0, n: 2}
seeds: [1]
steps: 24
warmup: 2
early_steps: 10
tail_steps: 5
overrides: [data.batch_size=8, model.block_size=64]
"""


def test_lr_sensitivity_best_lr_and_verdicts_by_hand():
    # L0 = 5; a diverged (NaN) cell counts as L0, a loss above L0 is clipped to it
    assert sensitivity([3.0, 2.0, 2.5, math.nan], 5.0) == (
        pytest.approx((1 + 0 + 0.5 + 3) / 4),
        2.0,
    )
    assert sensitivity([3.0, 2.0, 7.0], 5.0)[0] == pytest.approx((1 + 0 + 3) / 3)
    # the parabola through (-3, 3), (-2, 2), (-1, 2.5) in log10 LR: vertex at -2 + 1/6
    best, edge = refine_best([1e-3, 1e-2, 1e-1], [3.0, 2.0, 2.5])
    assert best == pytest.approx(10 ** (-2 + 1 / 6)) and not edge
    assert refine_best([1e-3, 1e-2, 1e-1], [1.0, 2.0, 3.0]) == (1e-3, True)
    # the words follow the numbers: 0.7 inside [min, max] and 1 outside; both inside; outside
    assert ratio_verdict({"min": 0.5, "max": 0.9}, 0.7) == "supported"
    assert ratio_verdict({"min": 0.5, "max": 1.2}, 0.7) == "not resolved"
    assert ratio_verdict({"min": 0.8, "max": 1.2}, 0.7) == "not supported"
    assert spearman([1, 2, 3, 4], [10, 20, 15, 40]) == pytest.approx(1 - 6 * 2 / (4 * 15))


def _csv_losses(cell) -> list[float]:
    (f,) = cell.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(f.open()))
    return [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]


@pytest.mark.slow  # ~60 s (the suite passed 15 minutes on the EPYC); the submitit cell and
# the bad-spec tests below keep stabilize-map's launch and refusal paths in the default suite
def test_a_small_map_runs_through_multirun_marks_the_divergent_cell_and_skips_on_relaunch(
    tmp_path,
):
    (tmp_path / "t.yaml").write_text(SPEC)
    args = ["stabilize-map", "--spec", "t.yaml", "--dir", "m", "--jobs", "2"]
    r = run_cli([*args, "--wandb"], cwd=tmp_path)  # W&B offline (conftest)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert out[0].startswith("[map] t: 2 recipes x 2 LRs (0.001 .. 1, log-spaced) x 1 seeds")
    assert out[1].startswith(
        "[map] 0 finished (skipped), 4 to run, 2 at a time (hydra/launcher=joblib)"
    )
    assert len([x for x in out if x.startswith("[map] ") and "/4 " in x]) == 4  # per cell
    m = tmp_path / "m"
    for recipe in ("layernorm", "layernorm-qknorm"):  # Hydra's own record of a multirun
        assert (m / "cells" / recipe / "multirun.yaml").is_file()
    data = json.loads((m / "map.json").read_text())
    cells = {(c["recipe"], c["lr"]): c for c in data["cells"]}
    assert len(cells) == 4
    for (recipe, lr), c in cells.items():
        d = m / "cells" / recipe / f"lr{lr}-seed1"
        losses = _csv_losses(d)
        assert c["final_loss"] == pytest.approx(sum(losses[-5:]) / 5, rel=1e-6) or not all(
            map(math.isfinite, losses[-5:])
        )
        assert abs(c["loss0"] - math.log(256)) < 0.15  # a byte model at init
        assert json.loads((d / "config.json").read_text())["rollback"]["enabled"] is False
    # the planted divergent cell: LR 1 without qk-norm, with its mechanism and step
    hot = cells["layernorm", 1.0]
    assert hot["diverged"] and hot["final_loss"] > hot["loss0"]
    assert hot["first_monitor"] and hot["mechanism"].startswith(
        ("attention-logit growth", "attention-entropy collapse", "loss spike", "grad-norm")
    )
    assert 1 <= hot["diverged_step"] <= 24
    assert (
        not cells["layernorm", 0.001]["diverged"]
        and not cells["layernorm-qknorm", 0.001]["diverged"]
    )
    # W&B, real offline files: each cell in group map-t, and a job_type=map run whose media
    # holds the cells' table (its rows the map's own cells) and the two figures
    for c in cells.values():
        d = m / "cells" / c["recipe"] / f"lr{c['lr']}-seed1"
        (w,) = find_offline_runs(d / "wandb")
        assert read_offline_run(w).group == "map-t"
    (summary,) = find_offline_runs(m / "wandb")
    w = read_offline_run(summary)
    assert (w.group, w.job_type) == ("map-t", "map") and "layernorm/lr_sensitivity" in w.summary
    (table,) = summary.glob("files/media/table/map/cells_*.table.json")
    got = json.loads(table.read_text())
    assert got["columns"][:3] == ["recipe", "lr", "seed"] and len(got["data"]) == 4
    assert sorted((row[0], row[1]) for row in got["data"]) == sorted(cells)
    assert len(list(summary.glob("files/media/images/map/*.png"))) == 2
    md = (m / "map.md").read_text()
    assert "| layernorm | " in md and (m / "loss_vs_lr.png").stat().st_size > 10_000
    assert (m / "outcomes.png").stat().st_size > 10_000
    # a relaunch skips them all; with one cell's result gone, it runs that one alone
    stamp = {p: p.stat().st_mtime for p in m.glob("cells/*/*/result.json")}
    r = run_cli(args, cwd=tmp_path)
    assert r.returncode == 0 and "[map] 4 finished (skipped), 0 to run" in r.stdout
    assert {p: p.stat().st_mtime for p in m.glob("cells/*/*/result.json")} == stamp
    gone = m / "cells" / "layernorm-qknorm" / "lr1.0-seed1" / "result.json"
    gone.unlink()
    r = run_cli(args, cwd=tmp_path)
    assert r.returncode == 0 and "[map] 3 finished (skipped), 1 to run" in r.stdout, r.stdout
    assert gone.is_file()
    assert {p: p.stat().st_mtime for p in stamp if p != gone} == {
        p: v for p, v in stamp.items() if p != gone
    }


def test_a_dry_runs_recipe_line_pasted_into_a_shell_runs_its_cells(tmp_path):
    """``--dry-run`` prints each recipe's multirun as a shell line; pasted into bash as it
    is, it runs the cells the map would have (the map then counts them finished)."""
    (tmp_path / "t.yaml").write_text(SPEC.replace("max: 1.0, n: 2", "max: 1.0e-3, n: 1")
                                     .replace("steps: 24", "steps: 3"))  # fmt: skip
    args = ["stabilize-map", "--spec", "t.yaml", "--dir", "m", "--jobs", "1"]
    r = run_cli([*args, "--dry-run"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if not x.startswith("[map] ")]
    assert len(lines) == 2 and "hydra.sweep.dir=m/cells/layernorm " in lines[0], lines
    assert not (tmp_path / "m").exists()  # a dry run launches nothing
    r = run_cli(["bash", "-c", lines[0]], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cell = tmp_path / "m" / "cells" / "layernorm" / "lr0.001-seed1"
    assert json.loads((cell / "result.json").read_text())["status"] == "done"
    r = run_cli([*args, "--dry-run"], cwd=tmp_path)
    assert "[map] 1 finished (skipped), 1 to run" in r.stdout, r.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher is not installed",
)
@pytest.mark.slow  # 17 s; the map's cells through joblib stay in the default suite
def test_submitits_local_executor_runs_a_cell(tmp_path):
    spec = SPEC.replace("lr: {min: 1.0e-3, max: 1.0, n: 2}", "lr: {min: 1.0e-3, max: 1.0e-3, n: 1}")
    spec = spec.replace("  layernorm-qknorm: [norm=layernorm, norm.qk_norm=true]\n", "")
    (tmp_path / "t.yaml").write_text(spec)
    args = ["--spec", "t.yaml", "--dir", "m", "--launcher", "submitit_local"]
    r = run_cli(["stabilize-map", *args, "--", "hydra.launcher.timeout_min=10"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hydra/launcher=submitit_local" in r.stdout
    (c,) = json.loads((tmp_path / "m" / "map.json").read_text())["cells"]
    assert c["status"] == "done" and not c["diverged"]
    # submitit's own files: the job's pickled result and its logs
    assert list((tmp_path / "m" / "cells" / "layernorm").glob(".submitit/*/*_result.pkl"))


def test_a_bad_spec_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "t.yaml").write_text(SPEC.replace("steps: 24", "stepz: 24"))
    r = run_cli(["stabilize-map", "--spec", "t.yaml", "--dir", "m"], cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("stabilize-map: map.stepz is not a setting of a map")
    assert "allowed: ['early_steps'" in line and not (tmp_path / "m").exists()
    r = run_cli(["stabilize-map", "--lrs", "1e-3:1", "--dir", "m"], cwd=tmp_path)
    assert r.returncode == 2 and "--lrs='1e-3:1' is not allowed; allowed: MIN:MAX:N" in r.stderr


def test_a_recipe_with_a_bad_key_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "t.yaml").write_text(SPEC.replace("norm.qk_norm=true", "norm.qk_nrom=true"))
    r = run_cli(["stabilize-map", "--spec", "t.yaml", "--dir", "m"], cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("stabilize-map: map.recipes.layernorm-qknorm (with the map's overrides)")
    assert "qk_nrom" in line and not (tmp_path / "m").exists()


def _cell(recipe, lr, seed, loss, **kw):
    from stabilize.map.cells import CellResult

    base = dict(status="done", loss0=5.5, final_loss=loss, bpb=None, diverged=loss >= 5.5,
                diverged_step=None, first_monitor=None, first_step=None, mechanism=None,
                grad_early=None, attn_logit_max=None, log_z_final=None, seconds=1.0)  # fmt: skip
    return CellResult(recipe=recipe, lr=lr, seed=seed, **{**base, **kw})


def test_the_claims_verdicts_follow_the_numbers_beside_them():
    """Synthetic cells with known numbers: the bound grows with the LR without qk-norm and
    is lower with it; qk-norm's sensitivity is below layernorm's in every seed; z-loss's
    log Z is lower at 2 of 3 LRs (not resolved)."""
    from stabilize.map.analysis import summarize
    from stabilize.map.claims import claims

    lrs = [1e-3, 1e-2, 1e-1]
    ln_q_bound = list(zip([3.0, 2.0, 6.0], [3.0, 2.0, 2.5], [10, 100, 1000], strict=True))
    cells = []
    for s in (1, 2):
        for lr, (ln, qk, bound) in zip(lrs, ln_q_bound, strict=True):
            cells.append(_cell("layernorm", lr, s, ln + 0.01 * s, attn_logit_max=float(bound),
                               log_z_final=5.0))  # fmt: skip
            cells.append(_cell("layernorm-qknorm", lr, s, qk + 0.01 * s, attn_logit_max=8.0))
        for lr, z in zip(lrs, [4.0, 4.0, 6.0], strict=True):
            cells.append(_cell("layernorm-zloss", lr, s, 2.5, log_z_final=z))
    recipes = [summarize(r, cells) for r in ("layernorm", "layernorm-qknorm", "layernorm-zloss")]
    got = {c["claim"]: c for c in claims(recipes, cells)}
    grows = got["without qk-norm the attention logit grows with the LR; qk-norm lowers it:"]
    assert (
        grows["verdict"] == "supported" and "rank correlation with the LR 1.00" in grows["evidence"]
    )
    assert "at LR 0.1: 1e+03 without, 8 with" in grows["evidence"]
    sens = got["qk-norm lowers the LR sensitivity:"]
    # by hand: layernorm's curve (3.01, 2.01, 5.5 clipped) - 2.01 -> (1 + 0 + 3.49) / 3
    assert sens["verdict"] == "supported" and sens["evidence"].endswith("without")
    assert recipes[0].sensitivity == pytest.approx((1.0 + 0 + (5.5 - 2.015)) / 3, abs=1e-9)
    z = got["z-loss lowers log Z:"]
    assert z["verdict"] == "not resolved" and "lower at 2 of 3 LRs" in z["evidence"]


@pytest.mark.slow  # ~40 s: a map interrupted mid-cell, then relaunched
def test_ctrl_c_stops_the_cells_in_flight_and_the_same_command_goes_on(tmp_path):
    """SIGINT to stabilize-map mid-cell: exit 130, one line, no cell process left; the
    relaunch runs every cell (the interrupted ones again, with resume=restart)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    spec = SPEC.replace("  layernorm-qknorm: [norm=layernorm, norm.qk_norm=true]\n", "")
    (tmp_path / "t.yaml").write_text(spec.replace("steps: 24", "steps: 150"))
    exe = str(Path(sys.executable).parent / "stabilize-map")
    args = [exe, "--spec", "t.yaml", "--dir", "m", "--jobs", "2"]
    p = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    cell = tmp_path / "m" / "cells" / "layernorm" / "lr0.001-seed1"
    t0 = time.monotonic()
    while not (cell / "config.json").exists() and time.monotonic() - t0 < 120:
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    assert out.splitlines()[-1] == (
        "[map] interrupted: 0 of 2 cells finished; the same command goes on with the rest"
    )
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "m" / "cells") not in ps  # no cell left running
    # another step count into the same dir is refused: its cells ran with 150
    (tmp_path / "t.yaml").write_text(spec)
    r = run_cli(args, cwd=tmp_path)
    assert (
        r.returncode == 2 and "map.steps=24 is not allowed in m: its cells ran with 150" in r.stderr
    )
    (tmp_path / "t.yaml").write_text(spec.replace("steps: 24", "steps: 150"))
    r = run_cli(args, cwd=tmp_path)
    assert r.returncode == 0 and "[map] 0 finished (skipped), 2 to run" in r.stdout, r.stdout
