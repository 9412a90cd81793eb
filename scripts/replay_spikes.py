"""Replay the loss-spike detector over finished runs' logged losses: the old one (window
MAD, warm-up 50) beside the current default (trend-robust sigma, monitor.loss_spike), so a
change to the detector is judged on runs nobody tuned it on.

    python scripts/replay_spikes.py runs/nan_repro-*/*/

Prints, per run dir: the steps logged, then each detector's spikes (step, z, loss, median).
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from stabilize.monitors.spikes import LossSpikeConfig, SpikeDetector, SpikeMonitor


@dataclass
class OldLossSpikeConfig(LossSpikeConfig):
    """The old loss detector: the window's MAD (not trend-robust) and a 50-step warm-up."""

    trend_robust: ClassVar[bool] = False
    warmup: int = 50


def losses(run_dir: Path) -> list[tuple[int, float]]:
    out = []
    for version in sorted((run_dir / "csv").glob("version_*")):
        with open(version / "metrics.csv", newline="") as f:
            for r in csv.DictReader(f):
                if r.get("train/loss_step") and r.get("train/step"):
                    out.append((int(float(r["train/step"])), float(r["train/loss_step"])))
    return out


def spikes(detector: SpikeDetector, series: list[tuple[int, float]]) -> list[str]:
    found = []
    for step, v in series:
        for e in detector.update(step, v):
            found.append(
                f"{step} (z {e.extra['z']:.1f}, {v:.3g} vs median {e.extra['median']:.3g})"
            )
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    args = ap.parse_args()
    c = LossSpikeConfig()
    for d in args.run_dirs:
        series = losses(d)
        old = SpikeDetector(OldLossSpikeConfig())
        new = SpikeMonitor.from_config("loss_spike", c, series="loss").detector
        print(f"{d}: {len(series)} steps")
        for label, det in (("old (MAD, warm-up 50)", old), ("now (default)", new)):
            found = spikes(det, series)
            shown = ", ".join(found[:3]) + (f" ... ({len(found)} in all)" if len(found) > 3 else "")
            print(f"  {label}: {shown or 'none'}")


if __name__ == "__main__":
    main()
