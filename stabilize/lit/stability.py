"""The stability callback: the stability engine (stability/engine.py) driven by Lightning.

Thin: the engine decides (probe, gather, monitors, re-run classification, localization,
bundle, snapshot, rollback with a remedy, abort); this file maps Lightning's hooks to the
engine's step protocol and answers its ``Loop`` from the Trainer (lit/loop.py). Our own
``GPTLitModule`` is its own ``Host``; any other LightningModule gets a ``LightningHost``
(lit/host.py), which this callback drives.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from stabilize.faults import FaultConfig
from stabilize.lit.host import LightningHost, module_path
from stabilize.lit.loop import LightningLoop
from stabilize.monitors import MonitorConfig
from stabilize.rollback import RollbackConfig
from stabilize.rollback.state import TrainState
from stabilize.stability.arguments import check_callback, settings, watched
from stabilize.stability.controller import StabilityAbort
from stabilize.stability.engine import StabilityEngine


class StabilityCallback(L.Callback):
    """The stability engine in a Lightning ``Trainer`` (see the module doc).

    Writes, in ``run_dir``: ``events.jsonl`` (every verdict), ``bundles/`` (a repro bundle
    per fault), ``snapshots/`` (the durable snapshots), ``diagnosis.json`` (on an abort),
    ``config.json`` and ``result.json`` (for a model we did not write), and the per-step
    metrics to every logger of the Trainer."""

    def __init__(
        self,
        monitor: MonitorConfig | dict | None = None,
        rollback: RollbackConfig | dict | None = None,
        fault: FaultConfig | dict | None = None,
        run_dir: str | Path | None = None,
        accumulate: int | None = None,
        *,
        model: nn.Module | str | None = None,
        blocks: str | None = None,
        skip_items: Iterable[str] | str = (),
        factory: str | None = None,
        layer_panels: int = 24,
    ):
        """Settings as the ``stabilize-train`` groups (``monitor``, ``rollback``, ``fault``):
        a dataclass, a dict of its keys, or None for the defaults. ``run_dir``: where
        events, bundles and snapshots go (default: the Trainer's log dir). ``accumulate``:
        default the Trainer's ``accumulate_grad_batches``. For a LightningModule we did not
        write (docs/your-model.md): ``model``, the network to watch (a module or an
        attribute path; default the child holding every parameter), ``blocks``, a glob
        naming its residual blocks (default the longest ModuleList), ``factory``,
        ``pkg.mod:fn`` that rebuilds the module for ``stabilize-replay`` (default its
        class with its saved ``hparams``). ``skip_items``: ``data.skip_items``.
        ``layer_panels``: ``logger.layer_panels`` (stability/wandb_layers.py)."""
        # every argument checked before anything is made (arguments.py: one line each)
        monitor, rollback, fault = settings(monitor, rollback, fault)
        skip_items = check_callback(run_dir, accumulate, model, blocks, factory, skip_items)
        self.engine = StabilityEngine(monitor, rollback, fault, run_dir, accumulate or 1,
                                      skip_items=skip_items, layer_panels=layer_panels)  # fmt: skip
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.accumulate = accumulate
        self._model, self._blocks, self.factory = model, blocks, factory
        self.host = None  # GPTLitModule itself, or a LightningHost (set up in setup)
        self._driven = False  # the host is a LightningHost: this callback drives it
        self._budget = -1  # a foreign module's max_steps, counted in model steps
        self._host_state: dict | None = None

    # the engine's parts, by the names the tests and benchmarks reach for
    @property
    def mcfg(self) -> MonitorConfig:
        return self.engine.mcfg

    @property
    def rcfg(self) -> RollbackConfig:
        return self.engine.rcfg

    @property
    def probe(self):
        return self.engine.probe

    @property
    def last(self):
        return self.engine.last

    @property
    def counts(self) -> dict[str, int]:
        return self.engine.counts

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        loop = LightningLoop(trainer)
        self._own_host(trainer, pl_module, loop)  # a refused module makes no dir
        self.engine.settle(self.run_dir, self.accumulate)
        self.engine.setup(loop, self.host, self._blocks, describe=self._driven)

    def _own_host(self, trainer: L.Trainer, pl_module: L.LightningModule,
                  loop: LightningLoop) -> None:  # fmt: skip
        """Our GPTLitModule is its own host; any other LightningModule gets a
        LightningHost. The run dir, accumulation and budget are settled."""
        if self.run_dir is None:
            self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if self.accumulate is None:
            self.accumulate = int(trainer.accumulate_grad_batches)
        if isinstance(getattr(pl_module, "train_state", None), TrainState):
            self.host, self._driven = pl_module, False
            return
        model = watched(pl_module, self._model, self.engine.fcfg)
        self.host = LightningHost(pl_module, trainer, loop, model, self.engine.rcfg,
                                  self.factory)  # fmt: skip
        self._driven = True
        if self._host_state:  # a checkpoint's state loaded before setup
            self.host.load(self._host_state)
        where = module_path(pl_module)
        if where.startswith("__main__:") and self.factory is None and trainer.is_global_zero:
            print(f"[stability] {where} is defined in a script: its repro bundles cannot be "
                  "replayed in another process (move it to a module, or give "
                  "StabilityCallback(factory='pkg.mod:fn'))", flush=True)  # fmt: skip
        if trainer.max_steps > 0:  # the model's steps, not Lightning's (which never rewind)
            self._budget = trainer.max_steps
            trainer.fit_loop.epoch_loop.max_steps = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._driven:  # one optimizer: Lightning's automatic optimization allows no more
            self.host.start()
            self.engine.write_run_info()
        self.engine.start()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.engine.close()
        if self._driven:
            self.engine.write_result("done")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:  # fmt: skip
        # an abort or a crash: the durable snapshot in flight is still written, then the
        # original exception goes on
        self.engine.fail()
        if self._driven and self.run_dir.is_dir():  # not a set-up refused before the dir
            aborted = isinstance(exception, StabilityAbort)
            self.engine.write_result("aborted" if aborted else "failed", repr(exception))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.engine.writer.close()

    # ---- per step -----------------------------------------------------------------------
    # The verdict is reached in on_before_optimizer_step: gradients are unscaled and the
    # loss known, but nothing is applied yet. A bad step is then made a no-op, so the
    # weights the localization replays and the snapshot ring never see it; the restore
    # itself waits for on_train_batch_end, after Lightning's step, scaler update and
    # scheduler bookkeeping.
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self._driven:
            self.host.batch_start()
        self.engine.micro_batch(batch)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           loss: torch.Tensor) -> None:  # fmt: skip
        if self._driven:
            self.host.saw_loss(loss)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning calls this before the module's own hook, where a fault may write a
        # parameter, and a foreign module's fault writes in the host's: the snapshot's
        # copies in flight have landed by then
        self.engine.after_backward()
        if self._driven:
            self.host.after_backward()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:  # fmt: skip
        if self._driven:
            self.host.stepping()
        self.engine.judge()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self._driven:
            self.host.step_end(self.engine.batches, self.engine.positions)
        self.engine.step_end()
        if self._driven and 0 < self._budget <= self.host.train_state.model_step:
            trainer.should_stop = True

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the engine's state (monitors' windows, the
        ladder, the fault's course) and, for a module we did not write, its model steps
        and data position."""
        return {**self.engine.state_dict(), "host": self.host.saved() if self._driven else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)
        self._host_state = state.get("host")
        if self._driven and self._host_state:  # Lightning restores after setup
            self.host.load(self._host_state)
