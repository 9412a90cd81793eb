"""The stability callback and its parts: the step gather, the re-run classification, the
replay with NaN localization, the rollback controller and the event sink, one file each
(callback.py says when each runs)."""

from stabilize.lit.stability.callback import StabilityCallback
from stabilize.lit.stability.classify import Classifier
from stabilize.lit.stability.controller import RollbackController, StabilityAbort
from stabilize.lit.stability.gather import HEAD, StepGather
from stabilize.lit.stability.localize import replay
from stabilize.lit.stability.sink import EventSink

__all__ = [
    "Classifier",
    "HEAD",
    "EventSink",
    "RollbackController",
    "StabilityAbort",
    "StabilityCallback",
    "StepGather",
    "replay",
]
