"""The console side of the event sink: every event once, repeats summarised.

``events.jsonl`` keeps every event; the console gets a readable account of them. Events of
one kind from one monitor that follow each other within ``gap`` model steps are one episode:
its first event is printed in full, the rest are counted and the episode ends with one line
(``[stability] step 12-150: 139 skips (loss_scale) ...``) when the events stop, or when the
run ends. The rollback controller's own events (a rollback done, an abort) are always
printed in full: the ladder bounds them. In a run with rollback off a ROLLBACK verdict reads
"would roll back (rollback off)": nothing was rolled back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

from stabilize.monitors import Event

GAP = 25  # model steps between two events of one episode, at most
NOUNS = {"warn": "warnings", "skip": "skips", "rollback": "rollback verdicts"}


@dataclass
class Episode:
    first: int
    last: int
    count: int = 1
    layers: set[str] = field(default_factory=set)


class EventConsole:
    def __init__(self, rollback_on: bool = True, stream: TextIO | None = None, gap: int = GAP):
        self.rollback_on = rollback_on
        self.stream = stream
        self.gap = gap
        self.open: dict[tuple[str, str], Episode] = {}
        self.lines = 0  # printed so far (a test bounds it)

    def _print(self, line: str) -> None:
        print(f"[stability] {line}", file=self.stream or sys.stdout, flush=True)
        self.lines += 1

    def _head(self, e: Event) -> str:
        if e.kind == "rollback" and e.monitor != "rollback" and not self.rollback_on:
            return "would roll back (rollback off)"
        return e.kind.upper()

    def event(self, e: Event) -> bool:
        """One event (rank 0, not ``info``): printed (True: it opens an episode, or is the
        controller's), or counted into its open episode (False)."""
        if e.monitor == "rollback" or e.kind == "abort":  # the controller's: every one
            self._print(f"{self._head(e)} step {e.step}: {e.message}")
            return True
        key = (e.kind, e.monitor)
        ep = self.open.get(key)
        if ep is not None and abs(e.step - ep.last) <= self.gap:
            ep.count += 1
            ep.last = max(ep.last, e.step)
            ep.layers.update([e.layer] if e.layer else [])
            return False
        if ep is not None:
            self._close(key)
        self._print(f"{self._head(e)} step {e.step}: {e.message}")
        self.open[key] = Episode(e.step, e.step, layers={e.layer} if e.layer else set())
        return True

    def tick(self, step: int) -> None:
        """The model is at ``step``: episodes whose events stopped are summed up."""
        for key in [k for k, ep in self.open.items() if abs(step - ep.last) > self.gap]:
            self._close(key)

    def close(self) -> None:
        """End of the run (or an abort): every open episode is summed up."""
        for key in list(self.open):
            self._close(key)

    def _close(self, key: tuple[str, str]) -> None:
        ep = self.open.pop(key)
        if ep.count == 1:
            return  # its one event is on the console already
        kind, monitor = key
        noun = NOUNS.get(kind, f"{kind} events")
        if kind == "rollback" and not self.rollback_on:
            noun = "would-roll-back verdicts (rollback off)"
        layers = sorted(ep.layers)
        more = f" and {len(layers) - 4} more" if len(layers) > 4 else ""
        where = f" in {', '.join(layers[:4])}{more}" if layers else ""
        steps = f"step {ep.first}" if ep.first == ep.last else f"step {ep.first}-{ep.last}"
        self._print(f"{steps}: {ep.count} {noun} ({monitor}){where}; each one is in events.jsonl")
