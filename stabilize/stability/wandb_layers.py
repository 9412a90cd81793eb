"""W&B panels for a deep model: one chart per per-layer statistic instead of one per layer.

W&B's automatic workspace makes one panel per logged key, in a section per key prefix
(``act/``, ``norm_rms/``, ...). A 24-layer model logs a few keys per layer under each
prefix: hundreds of one-line panels. ``LayerPanels`` keeps that readable:

- a prefix with more than ``limit`` keys (``logger.layer_panels``; the callback's
  ``layer_panels``) is hidden from the automatic panels (``define_metric("act/*",
  hidden=True)``, recorded in the run itself): the keys are still logged, in the history
  and the CSV, and W&B's Quick add or search shows any one of them;
- at the end of training (or an exception) each hidden prefix gets one chart,
  ``layers/<prefix>``: every key of it as a line over the steps (``wandb.plot.line_series``),
  the layers in their model order. At most ``points`` steps per line are kept (every
  second log step dropped, then every fourth, ...), so a 12,000-step run draws the same
  size of chart as a 100-step one. A run killed without an exception gets no chart; its
  keys are all in the history.

Only rank 0 and only W&B runs (the loop's ``wandb_runs``: Lightning's ``WandbLogger``): the CSV
keeps every key in its own column whatever this does.
"""

from __future__ import annotations

import math
import re

# Per-layer series whose danger is their extreme (|x| max against 256, the largest row RMS
# against 255.94 / sqrt(D), the attention logit, a quantized operand's clipping and its
# lowest SQNR): the W&B runs table shows a key's summary, by default its last value, which
# after a rollback or a recovery is not the one that mattered.
PEAKS = {"act": "max", "rms": "max", "attn_logit": "max", "q_ratio": "max", "q_sat": "max",
         "q_under": "max", "q_clip": "max", "q_sqnr": "min"}  # fmt: skip

ALWAYS_SHOWN = ("train", "stability")  # the sink's own scalars: not per-layer


def layer_order(key: str) -> list:
    """A key's sort order with its numbers as numbers: ``h.2`` before ``h.10``."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", key)]


class LayerPanels:
    def __init__(self, limit: int = 24, points: int = 512):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < -1:
            raise ValueError(f"layer_panels={limit!r} is not allowed; must be an integer >= -1 "
                             "(-1: never group)")  # fmt: skip
        self.limit, self.points = limit, points
        self.keys: dict[str, set[str]] = {}  # prefix -> the keys seen under it
        self.hidden: set[str] = set()
        self.series: dict[str, list[tuple[int, float]]] = {}
        self._stride, self._seen = 1, 0  # log steps kept: every stride-th

    def add(self, loop, metrics: dict[str, float], step: int) -> None:
        """A log step's per-layer metrics (rank 0). Nothing is kept without a W&B logger,
        or with ``limit`` < 0."""
        if self.limit < 0 or not (exps := loop.wandb_runs()):
            return
        for key in metrics:
            prefix, sep, _ = key.partition("/")
            if sep and prefix not in ALWAYS_SHOWN:
                self.keys.setdefault(prefix, set()).add(key)
        for prefix, keys in self.keys.items():
            if prefix not in self.hidden and len(keys) > self.limit:
                self.hidden.add(prefix)
                peak = {"summary": PEAKS[prefix]} if prefix in PEAKS else {}
                for exp in exps:  # hidden, its summary kept (sink.py's PEAKS)
                    exp.define_metric(f"{prefix}/*", hidden=True, **peak)
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        for key, v in metrics.items():
            if key.partition("/")[0] in self.hidden:  # a non-finite point: a gap in its line
                pts = self.series.setdefault(key, [])
                if math.isfinite(v):
                    pts.append((step, float(v)))
        if self._seen > self.points * self._stride:  # thin out: every second point kept
            self._stride *= 2
            for key, pts in self.series.items():
                self.series[key] = pts[::2]

    def finish(self, loop) -> list[str]:
        """One ``layers/<prefix>`` chart per hidden prefix, to every W&B logger; the chart
        keys logged."""
        exps = loop.wandb_runs()
        if not exps or not self.hidden:
            return []
        import wandb

        charts = {}
        for prefix in sorted(self.hidden):
            keys = sorted((k for k in self.series if k.startswith(prefix + "/")), key=layer_order)
            if not keys:
                continue
            charts[f"layers/{prefix}"] = wandb.plot.line_series(
                xs=[[s for s, _ in self.series[k]] for k in keys],
                ys=[[v for _, v in self.series[k]] for k in keys],
                keys=[k.partition("/")[2] for k in keys],
                title=f"{prefix}: every layer ({len(keys)} series)",
                xname="step",
            )
        self.series = {}  # logged once
        for exp in exps:
            try:  # a chart W&B could not take never fails the run that made it
                exp.log(charts)
            except Exception as e:  # noqa: BLE001
                print(f"[stability] W&B per-layer charts not logged: {type(e).__name__}: {e}",
                      flush=True)  # fmt: skip
                return []
        return sorted(charts)
