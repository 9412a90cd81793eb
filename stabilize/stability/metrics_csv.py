"""``MetricsCsv``: the per-step metrics of a loop that has no logger of ours, written where
``stabilize-report`` reads a run's metrics (``csv/version_0/metrics.csv``, a ``step``
column and one column per key, as Lightning's CSVLogger writes them).

Rows are kept in memory and flushed every ``flush_every`` rows and at ``save()``: appended
while the columns stay the same, the whole file rewritten (atomically) when a new key
appears, so a crash loses at most the rows since the last flush.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from stabilize.io import atomic_write_text


class MetricsCsv:
    def __init__(self, run_dir: str | Path, flush_every: int = 50):
        self.path = Path(run_dir) / "csv" / "version_0" / "metrics.csv"
        self.flush_every = flush_every
        self.keys: list[str] = []
        self.rows: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({**metrics, "step": step})
        if len(self.rows) >= self.flush_every:
            self.save()

    def save(self) -> None:
        if not self.rows:
            return
        new = [k for r in self.rows for k in r if k not in self.keys]
        fresh = not self.path.exists()
        if new or fresh:
            self.keys += list(dict.fromkeys(new))
            old = [] if fresh else list(csv.DictReader(self.path.open(newline="")))
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=self.keys)
            w.writeheader()
            w.writerows([*old, *self.rows])
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, buf.getvalue())
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.keys).writerows(self.rows)
        self.rows = []
