"""The event sink: where the stability verdicts and per-step statistics go.

Events go to ``events.jsonl`` (one JSON line each, rank 0), the console (``console.py``:
repeats summarised, every event stays in the file), W&B alerts (warn,
rollback and abort) and the ``stability/*s`` counts; the per-layer statistics of a log step
go to every logger under the prefixes of ``monitors.SERIES_METRICS``; the step's loss, grad
norm and loss scale go to every logger on *every* step (``STEP_METRICS``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from stabilize.monitors import SERIES_METRICS, Event, StepStats
from stabilize.numerics import sum_of_squares_rms_limit
from stabilize.stability.console import EventConsole
from stabilize.stability.wandb_layers import PEAKS, LayerPanels

# The step's scalars, logged on every optimizer step under these names (once logged only
# every log_every_n_steps, a grad-norm peak of 13.7 showed up as 3.18). They are the host
# values the gather already holds (no extra sync): what the monitors judged, i.e. the mean
# loss over the step's micro-batches and the loss scale this step ran with (before the
# scaler's update). Lightning's ``train/loss`` etc. stay on log steps; the report reads
# these in their place where a run has them (report/load.py).
STEP_METRICS = {
    "loss": "train/loss_step",
    "grad_norm": "train/grad_norm_step",
    "loss_scale": "train/loss_scale_step",
}


ALERT_WAIT_S = 300  # W&B's wait_duration: alerts of one title, at most one per 5 minutes


class EventSink:
    def __init__(self, run_dir: str | Path, rollback_on: bool = True, layer_panels: int = 24):
        self.run_dir = Path(run_dir)
        self.layers = LayerPanels(layer_panels)
        self.counts = {"warn": 0, "skip": 0, "rollback": 0}  # counted on every rank
        self.console = EventConsole(rollback_on)
        self._rollbacks_at: dict[int, int] = {}  # model step -> rollback alerts sent
        self._peaks_defined: set[int] = set()  # the W&B runs told their PEAKS

    def close(self, loop) -> None:
        """End of training (or an abort): the console's open episodes are summed up."""
        if loop.is_zero:
            self.console.close()
            self.layers.finish(loop)

    def emit(self, loop, e: Event, **extra) -> None:
        if e.kind in self.counts:
            self.counts[e.kind] += 1
        if not loop.is_zero:
            return
        record = {**e.to_dict(), "global_step": loop.step, **extra}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        # one W&B alert per episode, as the console prints one line (a 120-step baseline
        # sent 327 before: each one an e-mail or a Slack message online)
        opened = e.kind != "info" and self.console.event(e)
        if opened and e.kind in ("warn", "rollback", "abort"):
            self._alert(loop, e)

    def _alert(self, loop, e: Event) -> None:
        """A W&B alert for the first event of an episode. W&B's own ``wait_duration``
        holds back a second alert of the same title within ``ALERT_WAIT_S`` (episodes of
        one monitor that flap); the rollback controller's own events are titled by their
        step, and a rollback also by its attempt at that step and its remedy: the second
        rollback of one step (often the one that fixed it) is not held back as a repeat of
        the first. Titles stay under W&B's 64 characters."""
        controller = e.monitor == "rollback" or e.kind == "abort"
        title = f"{e.kind}: {e.monitor}" + (f" at step {e.step}" if controller else "")
        if e.monitor == "rollback" and e.kind == "rollback":
            tries = self._rollbacks_at  # model step -> rollback alerts sent
            tries[e.step] = tries.get(e.step, 0) + 1
            remedy = str(e.extra.get("remedy", "?"))[:24]
            title = f"rollback at step {e.step}, attempt {tries[e.step]}: {remedy}"
        level = "WARN" if e.kind == "warn" else "ERROR"
        for run in loop.wandb_runs():
            run.alert(title=title, text=e.message, level=level, wait_duration=ALERT_WAIT_S)

    def log_stats(
        self,
        loop,
        s: StepStats,
        forecast: dict[str, float],
        dims: dict[str, int] | None,
        layers: bool = True,
        news: bool = True,
    ) -> None:
        """A step's statistics, one logger call: the scalars of ``STEP_METRICS`` on every
        step, and with ``layers`` (log steps) the per-layer series too. ``dims``: each norm's
        width (the probe's), for the headroom; ``forecast``: the monitors' steps left per
        layer. The loop's dashboards (W&B) get the log steps and the steps with ``news``
        (an event) or a non-finite value; its local files every step."""
        m: dict[str, float] = {"train/step": float(s.step)}
        if layers:
            m.update(self._layer_metrics(s, forecast, dims))
        # kept when non-finite: a NaN loss or an inf grad norm is the news
        m.update({k: float(v) for f, k in STEP_METRICS.items() if (v := getattr(s, f)) is not None})
        # Host floats, straight to the loggers (rank 0): self.log's per-key bookkeeping
        # cost ~10 ms per log step for the per-layer series.
        if loop.is_zero:
            self.console.tick(s.step)
            # the step the loop's own rows use at this point, so per-layer rows line up
            # with train/loss in CSV and W&B
            step = loop.log_row
            self._define_peaks(loop)
            finite = all(math.isfinite(v) for v in m.values())
            loop.log(m, step, dashboards=layers or news or not finite)
            if layers:
                self.layers.add(loop, m, step)

    def _define_peaks(self, loop) -> None:
        """Each W&B run's summary of the ``PEAKS`` series is their extreme
        (``define_metric(..., summary=...)``, once per run), bound to the step metric the
        loop's logger binds every key to. W&B applies it when it receives the run (online,
        or at ``wandb sync``); the offline file holds the definition."""
        for run in loop.wandb_runs():
            if id(run) in self._peaks_defined:
                continue
            self._peaks_defined.add(id(run))
            step = loop.wandb_step_metric
            kw = {"step_metric": step, "step_sync": True} if step else {}
            for prefix, how in PEAKS.items():
                run.define_metric(f"{prefix}/*", summary=how, **kw)

    def _layer_metrics(
        self, s: StepStats, forecast: dict[str, float], dims: dict[str, int] | None
    ) -> dict[str, float]:
        m: dict[str, float] = {}
        for field, prefix in SERIES_METRICS.items():
            m.update({f"{prefix}/{k}": v for k, v in getattr(s, field).items()})
        # fp16 sum-of-squares headroom: how far each row RMS may still grow before the sum
        # over D elements passes 65504 (< 1: it already overflows), for norms whose RMS
        # is measured (the explicit backend, i.e. 16-bit reductions)
        if dims is not None:
            m.update(
                {
                    f"headroom/{k}": sum_of_squares_rms_limit(torch.float16, dims[k]) / v
                    for k, v in s.norm_rms_max.items()
                    if v > 0
                }
            )
        m.update({f"forecast/{k}": min(v, 1e6) for k, v in forecast.items()})
        m.update({f"stability/{k}s": float(v) for k, v in self.counts.items()})
        # a block's inf / nan gradient norm is the news (where it went non-finite); other
        # series past a non-finite step say nothing more and are left out
        return {k: v for k, v in m.items() if math.isfinite(v) or k.startswith("grad_norm/")}
