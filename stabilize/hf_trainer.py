"""``stabilize.HFStabilityCallback``: the stability engine in a Hugging Face ``Trainer``
(docs/your-model.md section 3). No Lightning here.

::

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   callbacks=[stabilize.HFStabilityCallback(run_dir="runs/hf")])
    trainer.train()

The Trainer's callbacks get ``model``, ``optimizer`` and ``lr_scheduler`` as keyword
arguments; the batch and each micro-batch's loss are read by a forward pre-hook and a
forward hook on the model (a Hugging Face model returns ``loss`` when given labels). The
step is judged in ``on_pre_optimizer_step`` (every micro-batch's backward done, nothing
applied) and ended in ``on_step_end``. What the Hugging Face loop does not allow, and what
the callback does instead (said once at start-up):

- the loop clips before ``on_pre_optimizer_step``: the callback takes the clipping over
  (``args.max_grad_norm`` is read, set to 0, and applied after the judgement with the same
  norm), so the monitors judge the pre-clip norm;
- no step skip: a bad step's gradients are set to None (the optimizer passes over a
  parameter without a gradient) and the state is then restored to a good snapshot, the
  LR schedule included;
- the data cannot be rewound (the loader is the Trainer's): after a rollback the data goes
  on; the Trainer counts its own steps, so a run rolled back k steps ends with k model
  steps fewer than ``max_steps``;
- FSDP and DeepSpeed are refused (their gradients are shards).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from stabilize.compat import scaler_unscaled
from stabilize.stability.arguments import check_callback, settings
from stabilize.stability.controller import StabilityAbort
from stabilize.stability.driven import DrivenHost, StabilityConfigError, refuse_fault
from stabilize.stability.engine import StabilityEngine
from stabilize.stability.loop import HandedLoop


class HFLoop(HandedLoop):
    """The engine's ``Loop`` from what the Trainer hands its callbacks."""

    def __init__(self, args, state, optimizer, scheduler, run_dir: Path):
        # accelerate's AcceleratedOptimizer: the torch optimizer and the scaler are public
        scaler = getattr(optimizer, "scaler", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        super().__init__(inner, scaler, [scheduler] if scheduler is not None else [], run_dir)
        self.args, self.state = args, state

    @property
    def step(self) -> int:
        return self.state.global_step

    log_row = step

    @property
    def log_every(self) -> int:
        every = self.args.logging_steps  # a float < 1 is a share of the run
        return max(1, int(every if every >= 1 else every * max(1, self.state.max_steps)))

    def log(self, metrics: dict[str, float], step: int, dashboards: bool = True) -> None:
        super().log(metrics, step)
        # the Trainer's W&B run, its x-axis named as it does
        for run in self.wandb_runs() if dashboards else ():
            run.log({**metrics, "train/global_step": step})

    wandb_step_metric = "train/global_step"  # what the Trainer's WandbCallback binds to

    def wandb_runs(self) -> list:
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        return [run] if run is not None else []


class HFHost(DrivenHost):
    """The ``Host`` for a Hugging Face model in its Trainer: the re-run is the model's own
    forward with the recorded inputs, its ``loss``."""

    def loss(self, batch) -> torch.Tensor:
        out = self.model(**batch)
        loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
        if loss is None:
            raise StabilityConfigError("the model returned no loss: give it labels")
        return loss

    def train_dataset(self):
        return getattr(self, "dataset", None)

    def host_info(self) -> dict[str, Any]:
        from stabilize.stability.driven import plain

        cls = type(self.model)
        return {"kind": "hf", "factory": self.factory, "model_path": "",
                "model_class": f"{cls.__module__}:{cls.__qualname__}",
                "config": plain(getattr(self.model, "config", None)),
                "loss": "model(**batch).loss", **self.fault_info()}  # fmt: skip


class HFStabilityCallback(TrainerCallback):
    """The stability harness for ``transformers.Trainer`` (see the module doc).

    Writes, in ``run_dir``: ``events.jsonl`` (every verdict), ``bundles/`` (a repro bundle
    per fault), ``snapshots/`` (the durable snapshots), ``diagnosis.json`` (on an abort),
    ``config.json``, ``result.json``, and the per-step metrics to
    ``csv/version_0/metrics.csv`` and the Trainer's W&B run, if any."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        monitor: Any = None,
        rollback: Any = None,
        fault: Any = None,
        factory: str | None = None,
        blocks: str | None = None,
    ):
        """``run_dir``: where events, bundles, snapshots and metrics go. ``monitor`` /
        ``rollback`` / ``fault``: the settings groups (a dataclass, a dict or None).
        ``factory``: ``pkg.mod:fn`` rebuilding the model for ``stabilize-replay`` (default:
        the model's class from transformers' own namespace, with its config). ``blocks``:
        a glob naming the residual blocks."""
        monitor, rollback, fault = settings(monitor, rollback, fault)
        check_callback(run_dir, 1, None, blocks, factory, ())
        if run_dir is None:
            raise StabilityConfigError("HFStabilityCallback(run_dir=None) is not allowed; "
                                       "allowed: a directory path")  # fmt: skip
        refuse_fault(fault, gradients=True)
        self.run_dir, self.factory, self.blocks = Path(run_dir), factory, blocks
        self.engine = StabilityEngine(monitor, rollback, fault, self.run_dir)
        self.loop: HFLoop | None = None
        self.host: HFHost | None = None
        self.clip = 0.0
        self._in_step = False  # between on_step_begin and on_pre_optimizer_step: forwards count
        self._hooks: list = []
        self._summed = False  # the micro-batches' losses sum to the step's (see _forward_in)
        self._asked: str | None = None  # args.fp16 / args.bf16, as the user asked
        self._autocast_hook: Any = None

    # ---- start and end ----------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None,
                       train_dataloader: Any = None, **kw: Any) -> None:  # fmt: skip
        if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
            raise StabilityConfigError("HFStabilityCallback with FSDP or DeepSpeed is not "
                                       "allowed: their gradients are shards; allowed: one "
                                       "process or DDP")  # fmt: skip
        model = _unwrapped(model)
        self.loop = HFLoop(args, state, optimizer, lr_scheduler, self.run_dir)
        host = self.host = HFHost(model, self.loop, self.engine.rcfg, self.factory,
                                  loss_factor=1.0)  # fmt: skip
        host.dataset = getattr(train_dataloader, "dataset", None)
        self._asked = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        # the clipping moves after the judgement (see the module doc)
        self.clip, args.max_grad_norm = float(args.max_grad_norm or 0.0), 0.0
        host.clip_norm = self.clip
        self.engine.setup(self.loop, host, self.blocks, describe=True)
        # the autocast is read inside the forward (accelerate wraps the model's forward in
        # it, and on CPU applies none for fp16): a child's pre-hook sees it
        inner = next((m for m in model.children()), model)
        self._autocast_hook = inner.register_forward_pre_hook(self._read_autocast)
        self._hooks = [model.register_forward_pre_hook(self._forward_in, with_kwargs=True),
                       model.register_forward_hook(self._forward_out)]  # fmt: skip
        host.start()
        self.engine.start()
        if self.loop.is_zero:
            print(f"[stability] Hugging Face Trainer: clipping at {self.clip:g} after the "
                  "judgement; a bad step's gradients dropped, then restored from a snapshot; "
                  "the data goes on after a rollback", flush=True)  # fmt: skip

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        self._end("done")

    def _end(self, status: str, error: str | None = None) -> None:
        for h in [*self._hooks, *([self._autocast_hook] if self._autocast_hook else [])]:
            h.remove()
        self._hooks = []
        try:
            if status == "done":
                self.engine.close()
            else:
                self.engine.fail()
            self.engine.write_result(status, error)
        finally:
            self.engine.writer.close()
            self.loop.csv.save()

    # ---- per step -----------------------------------------------------------------------
    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        self._in_step = True

    def _forward_in(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """A training micro-batch's forward starts: its inputs are the batch."""
        if not (self._in_step and module.training and torch.is_grad_enabled()):
            return
        self._in_step = "forward"
        batch = dict(kwargs)
        # the Trainer may pass the step's token count: then each micro-batch's loss is its
        # share of the step's mean (they sum to it); a re-run takes each micro-batch's own
        self._summed = batch.pop("num_items_in_batch", None) is not None
        self.host.batch_start()
        self.engine.micro_batch(batch)

    def _read_autocast(self, module: nn.Module, args: tuple) -> None:
        """The first training forward's autocast: what a re-run runs under."""
        if self._in_step != "forward":
            return
        self._autocast_hook.remove()
        dev = next(self.host.model.parameters()).device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        names = {torch.float16: "fp16-mixed", torch.bfloat16: "bf16-mixed"}
        self.loop.autocast = (dev, dtype) if dtype in names else None
        self.host.precision_name = names.get(dtype, "fp32")
        self.engine.write_run_info()
        if self._asked and dtype not in names and self.loop.is_zero:
            print(f"[stability] {self._asked}=True, but the Trainer's forward runs without "
                  f"autocast on {dev}: judged and replayed as fp32", flush=True)  # fmt: skip

    def _forward_out(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self._in_step != "forward":
            return
        self._in_step = True
        loss = out["loss"] if hasattr(out, "keys") else out[0]
        if isinstance(loss, torch.Tensor):
            self.host.saw_loss(loss, scaled=False)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        self._in_step = False
        host, engine = self.host, self.engine
        scaler, opt = self.loop.scaler(), self.loop.optimizer()
        if scaler is not None and not scaler_unscaled(scaler, opt):
            scaler.unscale_(opt)
        engine.gather.accumulate = 1 if self._summed else max(1, host.micro)
        engine.after_backward()  # the snapshot's copy has landed before a fault writes
        host.after_backward()
        host.stepping()
        engine.judge()
        if self.clip > 0 and not host.train_state.skip_step:
            params = [p for p in host.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, host.grad_total_norm())

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kw: Any) -> None:  # fmt: skip
        self.host.step_end(self.engine.batches, self.engine.positions)
        try:
            self.engine.step_end()
        except StabilityAbort as e:
            self._end("aborted", repr(e))
            raise

    @property
    def model_step(self) -> int:
        """The model's steps: taken and kept (a rollback moves it back)."""
        return self.host.train_state.model_step if self.host is not None else 0

    @property
    def last(self):
        return self.engine.last


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP's wrapper (the Trainer hands callbacks the wrapped one)."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    return model.module if ddp else model
