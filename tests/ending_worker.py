"""One rank of tests/test_ending.py: ``stabilize-train`` itself (Hydra, the checks, the exit
codes: ``stabilize.train.main``) given one Lightning callback more, through ``run``'s own
``callbacks`` argument. On rank ``STOP_RANK``, in the first attempt only (a group torchrun
restarts runs plain), the callback sends its own process a real signal (``STOP_SIGNAL``:
SIGSTOP freezes it, SIGKILL kills it) inside the final save: the save after the last step,
which the end of training writes when the last step was not a periodic checkpoint's.
A stop there has no other deterministic moment: the save takes milliseconds.

    python -m stabilize.launch --standalone --nproc-per-node 2 tests/ending_worker.py ARGS
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning as L

import stabilize.train as train
from stabilize.elastic import restart_count


class StopInFinalSave(L.Callback):
    def __init__(self, sig: signal.Signals):
        self.sig, self.ended = sig, False

    def on_train_end(self, trainer, pl_module):
        self.ended = True  # before the final save: Lightning ends Checkpoint callbacks last

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.ended:  # when, and where: the test times the watchdog from here
            stop = {"t": time.time(), "pid": os.getpid(), "step": trainer.global_step}
            Path(os.environ["STABILIZE_RUN_DIR"], "stopped.txt").write_text(repr(stop))
            os.kill(os.getpid(), self.sig)


def main() -> None:
    if int(os.environ["RANK"]) == int(os.environ["STOP_RANK"]) and restart_count() == 0:
        plain = train.run
        stop = StopInFinalSave(getattr(signal, os.environ["STOP_SIGNAL"]))
        train.run = lambda cfg, callbacks=(): plain(cfg, [*callbacks, stop])
    train.main()


if __name__ == "__main__":
    main()
