"""What a run dir must hold to be judged or replayed (``stabilize-gap``; ``stabilize-replay``'s
``--gap``, ``--tail``, ``--spike``), said in one line naming the dir before anything is
written. Judged as it is, a foreign or unfinished dir has no score at the run's end: the
judge would fall back to whatever partial curve is left and the verdict fall on the run that
did finish.

This layer reads files only: whether a ``config.json`` loads as stabilize-train's
``RunConfig`` is asked through ``loads`` by the callers that rebuild a run from it (the
replays, a layer above)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the sections of stabilize-train's config.json that the replays read and edit as they are
TRAIN_SECTIONS = ("model", "data", "optim", "precision", "trainer", "logger")
# what the stability callback writes on a loop of the user's (lit/stability.py): judged, not
# replayed (a replay rebuilds our GPT from a RunConfig)
OWN_LOOP_SECTIONS = ("precision", "host")


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(content, None), or (None, why it cannot be read, in words)."""
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"no {path.name}"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path.name} unreadable: {' '.join(str(e).split())}"


def _unfinished(d: Path, trainer: dict | None) -> list[str]:
    """How the run in ``d`` did not reach its end: no result.json (killed, or still
    training), another status (failed, aborted, preempted, hung), or done short of
    ``trainer.max_steps`` (``trainer.stop_at_step``)."""
    result, why = _read_json(d / "result.json")
    if why:
        gone = not (d / "result.json").exists()
        return [f"{why}: killed before its end, or still training" if gone else why]
    result = result if isinstance(result, dict) else {}
    status, step = result.get("status"), result.get("model_step")
    end = None if trainer is None else trainer.get("max_steps")
    of = "" if end is None else f" of trainer.max_steps={end}"
    if status != "done":
        return [f"result.json: status {status} at model step {step}{of}"]
    if end is not None and (not isinstance(step, int) or step < end):
        stop = trainer.get("stop_at_step")
        return [f"it stopped at model step {step}{of}"
                + ("" if stop is None else f", at trainer.stop_at_step={stop}")]  # fmt: skip
    return []


def run_dir_problem(path: str | Path, finished: bool = True, scored: bool = True,
                    own_loop: bool = False,
                    loads: Callable[[dict], Any] | None = None) -> str | None:  # fmt: skip
    """Why ``path`` cannot be judged or replayed as a run, in one line naming it; None when it
    can. A run dir: a ``config.json`` that loads as stabilize-train's ``RunConfig`` (or, with
    ``own_loop``, the stability callback's on a loop of the user's: judged only). With
    ``finished``: its ``result.json`` says done at its ``trainer.max_steps`` (the judge and
    the tail compare scores at the end of the run), and it has its held-out score
    (``final_eval.json``'s loss): always with ``scored`` (the replays score held out), else
    where its config asked for one (``trainer.final_eval_batches`` not 0). ``loads``: the
    check that the config builds (``RunConfig.from_saved``), raising on one that does not."""
    d = Path(path)
    if not d.is_dir():
        return f"{d}: not a run dir ({'not a directory' if d.exists() else 'it does not exist'})"
    saved, why = _read_json(d / "config.json")
    if why:
        return f"{d}: not a run dir ({why})"
    saved = saved if isinstance(saved, dict) else {}
    trainer = None
    theirs = all(isinstance(saved.get(k), dict) for k in OWN_LOOP_SECTIONS)
    if theirs and not own_loop:
        return (f"{d}: not a stabilize-train run (its config.json is the stability "
                "callback's, on a loop of the user's): a replay rebuilds stabilize-train's "
                "runs only")  # fmt: skip
    if not theirs:
        missing = [k for k in TRAIN_SECTIONS if not isinstance(saved.get(k), dict)]
        if missing:
            return (f"{d}: not a run dir (its config.json is not a stabilize run's: no "
                    f"{', '.join(missing)} section{'s' if len(missing) > 1 else ''})")  # fmt: skip
        trainer = saved["trainer"]
        try:
            if loads is not None:
                loads(saved)
        except (ValueError, TypeError, AttributeError, KeyError) as e:
            return (f"{d}: not a run dir (its config.json does not load as a stabilize run's: "
                    f"{' '.join(str(e).split())})")  # fmt: skip
    if not finished:
        return None
    unfinished = _unfinished(d, trainer)
    lacks = list(unfinished)
    off = trainer is not None and trainer.get("final_eval_batches") == 0
    if scored or (trainer is not None and not off):
        score, why = _read_json(d / "final_eval.json")
        loss = score.get("loss") if isinstance(score, dict) else None
        if why and not (d / "final_eval.json").exists():
            lacks.append("no final_eval.json to compare held out"
                         + (": trainer.final_eval_batches=0" if off else ""))  # fmt: skip
        elif why:
            lacks.append(why)
        elif not isinstance(loss, (int, float)) or not math.isfinite(loss):
            lacks.append(f"final_eval.json has no held-out loss (loss={loss!r})")
    if not lacks:
        return None
    what = "not a finished run" if unfinished else "no held-out score to compare"
    return f"{d}: {what} ({'; '.join(lacks)})"


def check_run_dirs(run: str | Path, refs: list[Path], run_finished: bool = True,
                   scored: bool = True, own_loop: bool = False,
                   loads: Callable[[dict], Any] | None = None) -> None:  # fmt: skip
    """``ValueError`` with ``run_dir_problem``'s line for the first of ``run`` and ``refs``
    (each named as a ``--reference``) it refuses; the references always finished."""
    for d, finished, role in [(run, run_finished, ""), *((r, True, "--reference ") for r in refs)]:
        problem = run_dir_problem(d, finished, scored, own_loop, loads)
        if problem:
            raise ValueError(role + problem)
