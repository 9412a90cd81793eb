"""The stability core, with no Lightning in it: the probe's statistics (``probe.py``,
``param_stats.py``), the step gather and its one host sync (``gather.py``), the re-run
classification (``classify.py``), the replay with NaN localization (``localize.py``), the
gradient scan (``grad_scan.py``), the rollback controller (``controller.py``), repro bundles
(``bundle.py``) and the event sink and console (``sink.py``, ``console.py``).
``stabilize.lit.stability.StabilityCallback`` is the Lightning callback that drives them.
"""

from stabilize.stability.classify import Classifier
from stabilize.stability.controller import RollbackController, StabilityAbort
from stabilize.stability.gather import HEAD, StepGather
from stabilize.stability.localize import replay
from stabilize.stability.probe import StabilityProbe
from stabilize.stability.sink import EventSink

__all__ = [
    "Classifier",
    "HEAD",
    "EventSink",
    "RollbackController",
    "StabilityAbort",
    "StabilityProbe",
    "StepGather",
    "replay",
]
