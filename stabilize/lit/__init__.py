"""What is really Lightning: the LightningModule (``module.py``), the trainer factory
(``build.py``) and the run (``runner.py``), the stability callback that drives
``stabilize.stability`` (``stability.py``), callbacks, checkpoints, FSDP, preemption, the
watchdog, progress, the norm audit and the final eval."""
