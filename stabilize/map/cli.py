"""``stabilize-map``: plan the cells, launch the unfinished ones through Hydra's multirun
with a parallel launcher, show progress per cell, then write the map's report.

    stabilize-map                                  # configs/map/default.yaml, both cores
    stabilize-map --spec my_map.yaml --dir runs/map-mine --jobs 4
    stabilize-map --launcher submitit_slurm -- hydra.launcher.partition=gpu trainer.devices=8
    stabilize-map --report runs/map-default        # the report only, from the cells on disk

Each recipe is one ``stabilize-train -m`` (its LRs x seeds; a relaunch sweeps only the
cells not finished, grouped into products), its console in ``DIR/logs/<recipe>.log``.
Cells go to ``DIR/cells/<recipe>/lr<lr>-seed<seed>/`` (Hydra's sweep dir and subdir).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from stabilize.exits import EXIT_CONFIG
from stabilize.map.cells import cell_dir, finished
from stabilize.map.spec import Cell, MapSpec, load_spec
from stabilize.validate import ConfigError

LAUNCHERS = ("joblib", "basic", "submitit_local", "submitit_slurm")
# The plan's estimate for a tiny cell: its start-up, and a step as the default map measured
# it (docs/map.md: `stabilize-map --dir /tmp/map-default` at commit 40d2732 on a 2-core Intel
# Xeon, 72 cells of 300 steps 2 at a time in 23.7 min: 39.5 s a cell = 5 s + 300 x 0.115 s).
# A lone healthy cell steps faster (0.08 s at 1 thread); the diverged cells' monitors and
# two cells sharing the cores make up the rest.
TINY_START_S, TINY_STEP_S = 5.0, 0.115


def groups(cells: list[Cell]) -> list[tuple[str, list[float], list[int]]]:
    """The cells as few (recipe, LRs, seeds) products as their LRs' seed sets allow."""
    out: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    by: dict[tuple[str, float], list[int]] = {}
    for c in cells:
        by.setdefault((c.recipe, c.lr), []).append(c.seed)
    for (recipe, lr), seeds in by.items():
        out.setdefault((recipe, tuple(sorted(seeds))), []).append(lr)
    return [(r, sorted(lrs), list(seeds)) for (r, seeds), lrs in out.items()]


def command(spec: MapSpec, root: Path, recipe: str, lrs: list[float], seeds: list[int],
            launcher: str, jobs: int, extra: list[str], wandb: bool) -> list[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "stabilize.train", "-m", *spec.cell_overrides(recipe), *extra]
    cmd += [f"optim.lr={','.join(str(lr) for lr in lrs)}", f"seed={','.join(map(str, seeds))}"]
    cmd += [f"name=map-{spec.name}", "resume=restart", f"hydra/launcher={launcher}"]
    cmd += [f"hydra.sweep.dir={root / 'cells' / recipe}"]
    cmd += ["hydra.sweep.subdir=lr${optim.lr}-seed${seed}"]  # Cell.key
    cmd += ["logger=wandb", f"logger.group=map-{spec.name}"] if wandb else ["logger=none"]
    if launcher == "joblib":
        cmd.append(f"hydra.launcher.n_jobs={jobs}")
    return cmd


def estimate(spec: MapSpec, extra: list[str], todo: int, jobs: int) -> str:
    custom = [o for o in [*spec.overrides, *extra] if o.split("=")[0] in ("model", "data")]
    if custom:
        return "unknown until the first cell finishes (not the tiny model)"
    s = todo * (TINY_START_S + spec.steps * TINY_STEP_S) / jobs
    took = f"~{s / 60:.0f} min" if s >= 90 else f"~{s:.0f} s"
    return f"{took} (the tiny model on a 2-core CPU, as the default map ran; refined as it runs)"


def check_recipes(spec: MapSpec, extra: list[str]) -> None:
    """Compose every recipe's first cell as stabilize-train would and build its RunConfig:
    a bad key or value is one line (naming the recipe) before anything is written or
    launched. The launcher's own settings (``hydra.*``) are Hydra's to check at launch."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from stabilize.config_store import store
    from stabilize.paths import config_dir
    from stabilize.run.preflight import build_config

    store()  # the dataclasses' defaults, which every option file starts from
    mine = [o for o in extra if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        for recipe in spec.recipes:
            ovr = [*spec.cell_overrides(recipe), *mine, f"optim.lr={spec.lrs[0]}",
                   f"seed={spec.seeds[0]}", "run_dir=unused"]  # fmt: skip
            try:
                values = OmegaConf.to_container(compose("train", overrides=ovr), resolve=True)
                values.pop("hydra", None)
                build_config(values)
            except (ConfigError, HydraException, OmegaConfBaseException) as e:
                why = str(e).split("\n")[0]
                where = f"map.recipes.{recipe} (with the map's overrides)"
                raise ConfigError(f"{where}: {why}") from None


# what a finished cell was run with: a relaunch may add LRs, seeds or recipes, not change these
CELL_KEYS = ("steps", "warmup", "overrides")


def check_same_cells(spec: MapSpec, root: Path) -> None:
    """A relaunch into a map's dir runs its cells as they were run: a changed step count,
    warm-up, common override or recipe is refused (the finished cells would not match)."""
    path = root / "map_spec.json"
    if not path.exists():
        return
    old = json.loads(path.read_text())
    diff = [k for k in CELL_KEYS if old.get(k) != getattr(spec, k)]
    diff += [f"recipes.{r}" for r, o in spec.recipes.items()
             if r in old.get("recipes", {}) and old["recipes"][r] != o]  # fmt: skip
    if diff:
        k = diff[0]
        was = old.get(k) if "." not in k else old["recipes"][k.split(".", 1)[1]]
        now = getattr(spec, k) if "." not in k else spec.recipes[k.split(".", 1)[1]]
        raise ConfigError(
            f"map.{k}={now!r} is not allowed in {root}: its cells ran with {was!r} "
            f"(changed: {', '.join(diff)}); use another --dir, or the same settings"
        )


def run_map(spec: MapSpec, root: Path, launcher: str, jobs: int, extra: list[str],
            wandb: bool = False, dry: bool = False) -> int:  # fmt: skip
    check_recipes(spec, extra)
    check_same_cells(spec, root)
    cells = spec.cells()
    done = [c for c in cells if finished(cell_dir(root, c))]
    todo = [c for c in cells if c not in done]
    lrs = spec.lrs
    print(f"[map] {spec.name}: {len(spec.recipes)} recipes x {len(lrs)} LRs ({lrs[0]:g} .. "
          f"{lrs[-1]:g}, log-spaced) x {len(spec.seeds)} seeds = {len(cells)} cells of "
          f"{spec.steps} steps -> {root}", flush=True)  # fmt: skip
    print(
        f"[map] {len(done)} finished (skipped), {len(todo)} to run, {jobs} at a time "
        f"(hydra/launcher={launcher}): {estimate(spec, extra, len(todo), jobs)}",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    if dry:  # each recipe's multirun as a shell line: pasted, it runs those cells
        threads = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
        for recipe, g_lrs, seeds in groups(todo):
            cmd = command(spec, root, recipe, g_lrs, seeds, launcher, jobs, extra, wandb)
            print(shlex.join([threads, "stabilize-train", *cmd[3:]]))
        return 0
    root.mkdir(parents=True, exist_ok=True)
    (root / "map_spec.json").write_text(json.dumps(spec.__dict__, indent=1))
    t0, n = time.monotonic(), len(done)
    for recipe, g_lrs, seeds in groups(todo):
        cmd = command(spec, root, recipe, g_lrs, seeds, launcher, jobs, extra, wandb)
        group = [Cell(recipe, lr, s) for lr in g_lrs for s in seeds]
        (root / "logs").mkdir(exist_ok=True)
        log = root / "logs" / f"{recipe}.log"
        with log.open("a") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            seen: set[Cell] = set()
            try:
                while True:
                    code = proc.poll()
                    for c in group:
                        if c not in seen and finished(cell_dir(root, c)):
                            seen.add(c)
                            n += 1
                            _progress(root, c, n, len(cells), len(done), t0, jobs)
                    if code is not None:
                        break
                    time.sleep(1.0)
            except KeyboardInterrupt:  # Ctrl-C: the cells in flight are stopped, none lost
                _stop(proc)
                left = len([c for c in cells if not finished(cell_dir(root, c))])
                print(f"[map] interrupted: {len(cells) - left} of {len(cells)} cells finished; "
                      "the same command goes on with the rest", flush=True)  # fmt: skip
                return 130
        if code != 0:
            said = [x for x in log.read_text().splitlines() if x.startswith("stabilize-train:")]
            last = f": {said[-1]}" if said else ""
            print(f"[map] {recipe}: stabilize-train -m exited {code}{last} (its console: {log})",
                  flush=True)  # fmt: skip
            if code == EXIT_CONFIG and len(seen) == 0:
                return EXIT_CONFIG
    from stabilize.map.report import write_report
    from stabilize.stability.bundle import versions

    meta = {"commit": versions()["git_commit"], "launcher": launcher, "jobs": jobs,
            "cells_run": len(todo), "seconds": round(time.monotonic() - t0, 1),
            "threads": env["OMP_NUM_THREADS"], "cpus": os.cpu_count()}  # fmt: skip
    (root / "map_meta.json").write_text(json.dumps(meta, indent=1))
    out = write_report(spec, root)
    print(f"[map] report: {out} ({len(todo)} cells run in {meta['seconds'] / 60:.1f} min)",
          flush=True)  # fmt: skip
    if wandb:
        from stabilize.map.report import to_wandb

        print(f"[map] W&B: {to_wandb(spec, root)}", flush=True)
    missing = [c for c in cells if not finished(cell_dir(root, c))]
    if missing:
        print(f"[map] {len(missing)} cells did not finish; relaunch to run them", flush=True)
        return 1
    return 0


def _stop(proc: subprocess.Popen) -> None:
    """The multirun and its workers: SIGINT first (Hydra and the cells end as on Ctrl-C),
    then SIGKILL after 30 s."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _progress(root: Path, c: Cell, n: int, total: int, skipped: int, t0: float, jobs: int):
    from stabilize.map.cells import read_cell

    try:
        r = read_cell(cell_dir(root, c), c, load_spec(root / "map_spec.json"))
        what = f"loss {r.final_loss:.3f}" + (
            f", diverged at step {r.diverged_step}" if r.diverged else ""
        )
    except (OSError, ValueError, KeyError, IndexError) as e:  # a half-read cell: said
        what = f"(not readable yet: {e})"
    ran = n - skipped
    rate = (time.monotonic() - t0) / ran
    eta = (total - n) * rate
    print(f"[map] {n}/{total} {c.recipe} lr {c.lr:g} seed {c.seed}: {what}; "
          f"ETA {eta / 60:.1f} min", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stabilize-map", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", type=Path, help="a map YAML (default: configs/map/default.yaml)")
    p.add_argument("--dir", type=Path, help="the map's directory (default: runs/map-NAME)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells at a time")
    p.add_argument("--launcher", default="joblib", choices=LAUNCHERS)
    p.add_argument("--steps", type=int, help="steps per cell (the spec's otherwise)")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 1,2,3")
    p.add_argument("--lrs", help="MIN:MAX:N, log-spaced")
    p.add_argument("--wandb", action="store_true", help="cells log to W&B, one group")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands")
    p.add_argument("--report", type=Path, metavar="DIR", help="only write DIR's report")
    p.add_argument("overrides", nargs="*", help="after --: stabilize-train overrides for "
                   "every cell (a model, a launcher's settings)")  # fmt: skip
    a = p.parse_args(argv)
    try:
        if a.report:
            from stabilize.map.report import write_report

            print(write_report(load_spec(a.report / "map_spec.json"), a.report))
            return 0
        kw = {"steps": a.steps}
        if a.seeds:
            kw["seeds"] = [_int("--seeds", s) for s in a.seeds.split(",")]
        if a.lrs:
            parts = a.lrs.split(":")
            if len(parts) != 3:
                raise ConfigError(f"--lrs={a.lrs!r} is not allowed; allowed: MIN:MAX:N")
            kw["lr"] = {"min": _float("--lrs", parts[0]), "max": _float("--lrs", parts[1]),
                        "n": _int("--lrs", parts[2])}  # fmt: skip
        if a.jobs < 1:
            raise ConfigError(f"--jobs={a.jobs} is not allowed; allowed: an integer >= 1")
        spec = load_spec(a.spec, **kw)
        root = a.dir or Path("runs") / f"map-{spec.name}"
        return run_map(spec, root, a.launcher, a.jobs, a.overrides, a.wandb, a.dry_run)
    except ConfigError as e:
        print(f"stabilize-map: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _int(key: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{key}: {v!r} is not allowed; allowed: an integer") from None


def _float(key: str, v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{key}: {v!r} is not allowed; allowed: a number") from None
