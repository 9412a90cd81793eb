"""Arms named by what differs between the runs, and the sweep's comparison table.

A scenario's arm has a name (``arm=`` in its config). A sweep member has none: Hydra names
its directory ``0``, ``1``... and the report would say "0 fixes it". So a run without an arm
is named by the swept keys: the command-line overrides (``.hydra/overrides.yaml``, what the
user typed) whose values differ between the runs compared, else the resolved configs' keys
that differ (runs composed in code, or read from W&B).
"""

from __future__ import annotations

from typing import Any

from stabilize.report.load import Run

# Keys that differ between any two runs without saying anything about them.
_NOT_SWEPT = ("run_dir", "resume", "logger.", "hydra.")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"norm.eps": "1e-06", ...}: nested config -> dotted keys, values as text."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)
    return out


def parse_overrides(lines: list[str]) -> dict[str, str]:
    """Hydra overrides of one run (each already one value: Hydra expanded the sweep) ->
    {key: value}; ``+key`` / ``++key`` count as ``key``, ``~key`` as deleted."""
    out = {}
    for o in lines:
        key, _, value = o.partition("=")
        if key.startswith("~"):
            out[key[1:]] = "(deleted)"
        else:
            out[key.lstrip("+")] = value
    return out


def swept(runs: list[Run]) -> list[dict[str, str]]:
    """Per run, {swept key: its value}: the keys whose values differ between the runs."""
    if len(runs) < 2:
        return [{} for _ in runs]
    if all(r.overrides is not None for r in runs):
        per_run = [parse_overrides(r.overrides or []) for r in runs]
        missing = "(default)"
    else:
        per_run = [flatten(r.config) for r in runs]
        missing = "-"
    keys = sorted({k for d in per_run for k in d if not k.startswith(_NOT_SWEPT)})
    differ = [k for k in keys if len({d.get(k, missing) for d in per_run}) > 1]
    if "arm" in differ and all(r.config.get("arm") for r in runs):
        differ = ["arm"]  # arms are named: what each arm changes is the arm
    return [{k: d.get(k, missing) for k in differ} for d in per_run]


def arm_names(runs: list[Run]) -> list[str]:
    """The name each run goes by in the report: its arm, else its swept key=value pairs,
    else its directory's name; a repeated name gets its seed added when the seeds tell the
    runs apart, else the directory's name."""
    names = []
    for r, values in zip(runs, swept(runs), strict=True):
        if r.config.get("arm"):
            names.append(str(r.config["arm"]))
        elif values:
            names.append(" ".join(f"{k}={v}" for k, v in values.items()))
        else:
            names.append(r.name)
    seen = [n for n in names if names.count(n) > 1]

    def distinct(n: str, r: Run) -> str:  # one arm over several seeds: name the seed
        seeds = {str(q.config.get("seed")) for q, m in zip(runs, names, strict=True) if m == n}
        if len(seeds) == names.count(n):
            return f"{n} seed {r.config.get('seed')}"
        return f"{n} ({r.name})"

    return [distinct(n, r) if n in seen else n for n, r in zip(names, runs, strict=True)]


def is_scenario(runs: list[Run]) -> bool:
    """A scenario's arms (experiment nan_repro*, or runs with an ``arm``): its conclusions
    (baseline chain, which arm fixes it) apply. A sweep gets a comparison table instead."""
    return any(
        r.config.get("arm") or str(r.config.get("name", "")).startswith("nan_repro") for r in runs
    )
