"""Runs as the report sees them, from any of three sources.

- a local run dir (the richest): ``config.json``, ``csv/version_*/metrics.csv`` (or a
  CSVLogger's own ``metrics.csv`` beside them),
  ``events.jsonl`` (exact steps of every warning, overflow, skip and rollback),
  ``audit.jsonl``, ``result.json`` / ``diagnosis.json``;
- W&B offline files (``wandb/offline-run-*``) when a run dir has no CSV log;
- the W&B API (``--wandb ENTITY/PROJECT --group G``): history and config; events are then
  rebuilt from the logged metrics, so their steps are only as fine as the log interval
  (``exact_events`` is False and the report marks those cells with ``~``).

Every source yields the same ``Run``: x is the optimizer step taken (monotonic, counting
rolled-back steps too), as W&B and the CSV log count it; ``report/axis.py`` maps it to the
model's own step, the one axis the report shows.

Unreadable input never stops the report: a malformed line of
events.jsonl / audit.jsonl, an unreadable metrics.csv or JSON file is skipped, and a
warning naming the file (and line) goes to ``Run.warnings`` (listed in report.md and on
stderr); everything else is still reported.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilize.wandb_offline import find_offline_runs, read_offline_run

# What the report reads of every audit.jsonl record (lit/audit.py writes them all).
AUDIT_KEYS = ("step", "rel_err_median", "flattened_share", "dead_share")


@dataclass
class Run:
    name: str
    arm: str
    config: dict[str, Any]
    rows: list[dict[str, float]]  # metric rows, each with "x": the optimizer step taken
    events: list[dict[str, Any]] = field(default_factory=list)
    audits: list[dict[str, Any]] = field(default_factory=list)
    status: str = "unknown"  # done | aborted | failed | unknown (no result.json)
    diagnosis: dict[str, Any] | None = None
    exact_events: bool = True
    source: str = ""
    # the command-line overrides Hydra recorded (.hydra/overrides.yaml); None when the run
    # was composed in code or read from W&B (the report then compares configs instead)
    overrides: list[str] | None = None
    # what could not be read, by file and line ("events.jsonl:7: not JSON ...")
    warnings: list[str] = field(default_factory=list)
    # the end-of-run score on the whole held-out split (final_eval.json), when it was made
    final_eval: dict[str, Any] | None = None
    path: Path | None = None  # the run dir (a local source): its bundles/ are named from it

    def series(self, key: str) -> list[tuple[float, float]]:
        """[(x, value)] of one metric, in logging order."""
        return [(r["x"], r[key]) for r in self.rows if key in r]

    def keys(self, prefix: str) -> list[str]:
        return sorted({k for r in self.rows for k in r if k.startswith(prefix)})


# The step's scalars logged on every step (stabilize/stability/sink.py STEP_METRICS) and
# the names the report reads: where a run has them they replace Lightning's log-step-only
# values, so a peak between log steps is in the table and the plots.
PER_STEP = {
    "train/loss_step": "train/loss",
    "train/grad_norm_step": "train/grad_norm",
    "train/loss_scale_step": "train/loss_scale",
}


def per_step(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Rows with each per-step series under its plain name (the log-step duplicates of a
    series the run logged per step dropped); rows of a run without them, unchanged."""
    have = {k for r in rows for k in r if k in PER_STEP}
    for r in rows:
        for k in have:
            r.pop(PER_STEP[k], None)
            if k in r:
                r[PER_STEP[k]] = r.pop(k)
    return rows


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


MAX_WARNINGS_PER_FILE = 5  # then one line counts the rest: a garbled file does not flood


def _warn_lines(warnings: list[str], path: Path, bad: list[tuple[int, str]]) -> None:
    """``path:line: problem`` for the first few bad lines of a file, then a count."""
    for line, problem in bad[:MAX_WARNINGS_PER_FILE]:
        warnings.append(f"{path}:{line}: {problem}; line skipped")
    if len(bad) > MAX_WARNINGS_PER_FILE:
        warnings.append(f"{path}: {len(bad) - MAX_WARNINGS_PER_FILE} more bad lines skipped")


def _jsonl(path: Path, warnings: list[str], required: tuple[str, ...]) -> list[dict[str, Any]]:
    """The records of a .jsonl file; a line that is not a JSON object with the ``required``
    keys (a step that is a number) is skipped with a warning naming the file and line."""
    if not path.exists():
        return []
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        warnings.append(f"{path}: unreadable ({e.strerror or e}); skipped")
        return []
    out, bad = [], []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:  # e.g. a line cut by a crash: the rest still counts
            bad.append((i, f"not JSON ({e.msg})"))
            continue
        missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
        if missing:
            bad.append((i, f"no {missing!r}" if isinstance(rec, dict) else "not a JSON object"))
        elif "step" in required and _num(rec["step"]) is None:
            bad.append((i, f"step={rec['step']!r} is not a number"))
        elif not isinstance(rec.get("extra") or {}, dict):
            bad.append((i, f"extra={rec['extra']!r} is not an object"))
        else:
            out.append(rec)
    _warn_lines(warnings, path, bad)
    return out


def _json(path: Path, warnings: list[str]) -> Any:
    """A JSON file's content; None when it is missing, or (with a warning) unreadable."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.append(f"{path}: unreadable ({e}); ignored")
        return None


def _version(p: Path) -> int:
    n = p.name.split("_")[-1]
    return int(n) if n.isdigit() else -1


def _csv_rows(run_dir: Path, warnings: list[str]) -> list[dict[str, float]]:
    """Every launch's metrics.csv, in order. A row with undecodable bytes is skipped with a
    warning naming the file and line; a file the csv reader gives up on keeps the rows read
    before the damage."""
    rows = []
    files = [v / "metrics.csv" for v in sorted((run_dir / "csv").glob("version_*"), key=_version)]
    # a run dir that is a CSVLogger's own log dir (the stability callback's default run dir
    # on a LightningModule of the user's: docs/your-model.md)
    files = files if any(f.exists() for f in files) else [run_dir / "metrics.csv"]
    for f in files:
        if not f.exists():
            continue
        bad: list[tuple[int, str]] = []
        try:
            with open(f, newline="", errors="replace") as fh:
                reader = csv.DictReader(fh)
                for row in reader:
                    cells = [*row.values(), *(row.get(None) or [])]
                    if any(isinstance(c, str) and "\ufffd" in c for c in cells):
                        bad.append((reader.line_num, "undecodable bytes"))
                        continue
                    r = {k: x for k, x in ((k, _num(x)) for k, x in row.items()) if x is not None}
                    if "step" in r:
                        # Lightning logs at the step count before this step's increment
                        r["x"] = r["step"] + 1
                        rows.append(r)
        except (OSError, csv.Error) as e:
            warnings.append(f"{f}: unreadable ({e}); the rest of the file skipped")
        _warn_lines(warnings, f, bad)
    return per_step(rows)


def _history_rows(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """W&B history rows (offline file or API) -> rows. Lightning's WandbLogger logs its step
    as ``trainer/global_step``; W&B's own ``_step`` counts log calls."""
    rows = []
    for h in history:
        step = _num(h.get("trainer/global_step", h.get("_step")))
        if step is None:
            continue
        r = {k: v for k, v in ((k, _num(v)) for k, v in h.items()) if v is not None}
        r["x"] = step + 1
        rows.append(r)
    return per_step(rows)


def _arm(config: dict[str, Any], fallback: str) -> str:
    return str(config.get("arm") or fallback)


def _overrides(run_dir: Path) -> list[str] | None:
    """What the user typed for this run (a sweep member: its one value of each swept key)."""
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.exists():
        return None
    import yaml

    data = yaml.safe_load(f.read_text()) or []
    return [str(o) for o in data] if isinstance(data, list) else None


def load_run_dir(path: str | Path) -> Run:
    """One local run directory (as stabilize-train writes it)."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"run dir {str(d)!r} does not exist")
    warnings: list[str] = []
    config = _json(d / "config.json", warnings)
    config = config if isinstance(config, dict) else {}
    rows, source = _csv_rows(d, warnings), "csv"
    if not rows:
        offline = find_offline_runs(d / "wandb")
        if offline:
            w = read_offline_run(offline[-1])
            rows, source = _history_rows(w.history), "wandb-offline"
            config = config or w.config
    events = _jsonl(d / "events.jsonl", warnings, ("kind", "monitor", "step"))
    if not rows and not config and not events:
        raise ValueError(
            f"{str(d)!r} is not a stabilize run dir: no config.json, no csv/ log, no wandb/ "
            f"offline run, no events.jsonl"
        )
    if not rows:
        warnings.append(f"{d}: no metric rows (csv/ or wandb/); the table shows events only")
    result = _json(d / "result.json", warnings)
    status = result.get("status", "unknown") if isinstance(result, dict) else "unknown"
    diag = _json(d / "diagnosis.json", warnings)
    score = _json(d / "final_eval.json", warnings) if (d / "final_eval.json").exists() else None
    return Run(
        name=d.name,
        arm=_arm(config, d.name),
        config=config,
        rows=rows,
        events=events,
        audits=_jsonl(d / "audit.jsonl", warnings, AUDIT_KEYS),
        status=str(status),
        diagnosis=diag if isinstance(diag, dict) else None,
        source=f"{source}: {d}",
        overrides=_overrides(d),
        warnings=warnings,
        final_eval=score if isinstance(score, dict) else None,
        path=d,
    )


def events_from_rows(rows: list[dict[str, float]], threshold: float = 256.0) -> list[dict]:
    """Rebuild the report's key events from logged metrics alone (a W&B API source): first
    non-finite loss, first |x| max over the line, overflowed reductions, rollbacks."""
    events: list[dict[str, Any]] = []
    seen_rollbacks = 0.0
    above: set[str] = set()
    nonfinite = False
    for r in rows:
        model_step = int(r.get("train/step", r["x"]))
        loss = r.get("train/loss")
        if loss is not None and not math.isfinite(loss) and not nonfinite:
            nonfinite = True
            events.append({"kind": "rollback", "monitor": "nonfinite", "step": model_step})
        for k, v in r.items():
            if k.startswith("act/") and v > threshold and k not in above:
                above.add(k)
                events.append(
                    {"kind": "warn", "monitor": "activation", "step": model_step, "layer": k[4:]}
                )
            if k.startswith("nan_rows/") and v > 0 and not r.get("overflow/" + k[9:]):
                events.append({"kind": "info", "monitor": "nan_rows", "step": model_step,
                               "layer": k[9:], "value": v, "extra": {"nan_rows": v}})  # fmt: skip
            if k.startswith("overflow/") and v > 0:
                norm = k[len("overflow/") :]
                events.append(
                    {
                        "kind": "warn",
                        "monitor": "overflow",
                        "step": model_step,
                        "layer": norm,
                        "value": v,
                        "extra": {
                            "collapsed": r.get("dead/" + norm, 0.0),
                            "nan_rows": r.get("nan_rows/" + norm, 0.0),
                        },
                    }
                )
        n = r.get("stability/rollbacks")
        if n is not None and n > seen_rollbacks:
            for _ in range(int(n - seen_rollbacks)):
                events.append({"kind": "rollback", "monitor": "rollback", "step": model_step})
            seen_rollbacks = n
    for e in events:
        e.setdefault("global_step", None)
    return events


def load_wandb(path: str, group: str) -> list[Run]:
    """Every run of a W&B group through the public API (needs network and a login)."""
    import wandb

    api = wandb.Api()
    runs = []
    for r in api.runs(path, filters={"group": group}):
        config = {k: v for k, v in r.config.items() if not k.startswith("_")}
        rows = _history_rows(list(r.scan_history()))
        runs.append(
            Run(
                name=r.name,
                arm=_arm(config, r.name),
                config=config,
                rows=rows,
                events=events_from_rows(rows),
                status={"finished": "done", "crashed": "failed"}.get(r.state, r.state),
                exact_events=False,
                source=f"wandb: {path}/{r.id}",
            )
        )
    if not runs:
        raise ValueError(f"no W&B runs in {path!r} with group {group!r}")
    return runs
