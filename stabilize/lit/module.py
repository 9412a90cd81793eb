"""The LightningModule: loss, AdamW with decoupled weight decay, warmup + cosine, clipping.

Two step counters live in ``train_state`` (rollback/state.py) besides Lightning's
``global_step``:
- ``model_step``: optimizer steps the *model* has taken. It is what the LR schedule, the
  logs (``train/step``) and, later, rollbacks speak of: Lightning's loop counters never
  rewind (Lightning issue #13099), the model's step does.
- ``data_step``: micro-batches consumed, the data position. The order of batches is a pure
  function of (seed, data_step) (stabilize.data.StepSampler), so resuming restarts there.
  With gradient accumulation A, an optimizer step is A micro-batches: data_step = A x
  model_step, plus the micro-batches skip_data remedies jumped over.

Accumulation windows: Lightning steps the optimizer when its own batch counter reaches a
multiple of A, and counts every batch it fetches. A batch prefetched before a rollback is
stale (not trained on, ``stale_batch``): left counted, it would shift every later window
off the data position's. So a stale batch is taken off Lightning's counters again
(``_uncount_stale``) and the windows stay whole: a rollback always lands on a window end
(verdicts come at the optimizer step), and the next window starts with the restored
position's first micro-batch.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

from stabilize.compat import scaler_scale, uncount_batch
from stabilize.lit.fsdp import full_norm, shard_model
from stabilize.lit.grad_reduce import fsdp_policy
from stabilize.lit.loaders import LoaderMixin
from stabilize.lit.optim_state import MasterWeights, round_moments_to_bf16
from stabilize.lit.saved_state import restore_state, saved_state
from stabilize.model import set_activation_checkpointing
from stabilize.model.logits import lm_loss
from stabilize.norms import Norm
from stabilize.rollback.remedies import lr_scale_at
from stabilize.rollback.state import TrainState
from stabilize.run.config import OptimConfig, RunConfig
from stabilize.run.model import build_run_model


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to 1, then cosine / linear decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def step_seed(seed: int, data_step: int, rank: int) -> int:
    """A 63-bit seed from (seed, step, rank), well mixed (splitmix64's finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + data_step * 0xBF58476D1CE4E5B9 + rank) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 1


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: no decay on norms, biases or embeddings (the tied head is wte)."""
    no_decay: set[int] = set()
    for m in model.modules():
        if isinstance(m, (nn.Embedding, Norm)):
            no_decay |= {id(p) for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            no_decay.add(id(p))
    params = list(model.parameters())  # deduplicated: the tied weight appears once
    return [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]


class GPTLitModule(LoaderMixin, L.LightningModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        # our GPT, or model=hf's architecture, its Linears quantized as quant says
        self.model = build_run_model(cfg)
        # the state the harness owns beside Lightning's (model/data step, LR scale, remedies,
        # skipped positions): shared with the stability callback, the rollback and the
        # remedies, and saved in checkpoints (rollback/state.py)
        self.train_state = TrainState(self.model)
        self.grad_norm: torch.Tensor | None = None  # last pre-clip total norm, on device
        self.master: MasterWeights | None = None  # optim.master_dtype=fp32 (configure_optimizers)
        self._saved_master: dict[str, torch.Tensor] = {}  # from a checkpoint, by name
        self._loader_cache = None  # (data step, (train, val) loaders): lit/loaders.py
        self._loss: torch.Tensor | None = None  # last micro-batch loss, logged on log steps
        self._batch_step: int | None = None  # the data step the incoming batch was drawn for
        self.stale_batch = False  # set per batch in on_before_batch_transfer
        self.step_loss: torch.Tensor | None = None  # sum over this step's micro-batches
        self.micro = 0  # fresh micro-batches of the current optimizer step trained so far
        self._uncount = False  # the last batch was stale: take it off Lightning's counters
        self._window_end = False  # this batch ended an accumulation window (logged then)
        self._grad_norm_at = -1
        self._batches_seen = 0  # every batch trained on, never rewound (a cache key)
        self.injector = None  # the fault injector, set by the stability callback

    def configure_model(self) -> None:
        if self.cfg.trainer.activation_checkpointing:  # before compile: traced with it
            set_activation_checkpointing(self.model, True)
        # After the callbacks' setup: the probe's and the faults' hooks are already on the
        # modules, so dynamo traces them into the compiled graph.
        if self.cfg.trainer.compile and not getattr(self, "_compiled", False):
            self.model.compile()
            self._compiled = True
        mesh = getattr(self, "_device_mesh", None)  # set by ModelParallelStrategy (lit/fsdp.py)
        if mesh is not None and not getattr(self, "_sharded", False):
            policy = fsdp_policy(self.cfg.trainer.grad_reduce_dtype)
            shard_model(self.model, mesh["data_parallel"], policy)
            self._sharded = True

    # ---- the rest of the stability core's Host protocol (stability/host.py) ---------------
    @property
    def clip_norm(self) -> float:
        return self.cfg.optim.grad_clip

    @property
    def precision_name(self) -> str:
        return self.cfg.precision.name

    def run_config(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def host_info(self) -> dict[str, Any]:
        """Our GPT is rebuilt from the bundle's ``config`` (replay/core.py)."""
        return {"kind": "gpt"}

    # ---- steps ----------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch, z_loss: bool = True) -> torch.Tensor:
        """Cross-entropy in fp32 whatever the activation dtype (``model.loss_dtype=logits``:
        in the logits' dtype), plus the model's z-loss
        (``model.z_loss``, or switched on by the z_loss remedy) unless ``z_loss=False``
        (validation: the held-out loss is the cross-entropy alone)."""
        x, y = batch  # [B, T] each
        logits = self.model(x)  # [B, T, V]
        # a training forward's log Z goes to the probe, read off the loss's own log-softmax
        sink = self.model.logit_softcap.stats_sink if self.training else None
        upcast = self.cfg.model.loss_dtype == "fp32"
        return lm_loss(logits, y, self.model.z_loss if z_loss else 0.0, sink, upcast)

    @property
    def window_start(self) -> bool:
        """Is the incoming batch the first trained micro-batch of an optimizer step?"""
        return not self.stale_batch and self.micro == 0

    def _uncount_stale(self) -> None:
        """Take the last (stale) batch off Lightning's batch counters, so that its
        ``ready % accumulate_grad_batches`` test (when to step the optimizer) and its
        ``batch_idx % accumulate_grad_batches`` test (when to zero the gradients) count only
        batches trained on. Run before the next batch is counted: by then the stale one has
        been through every stage (ready, started, processed, completed)."""
        uncount_batch(self.trainer)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training and len(batch) == 3:
            if self._uncount:
                self._uncount = False
                self._uncount_stale()
            x, y, steps = batch  # steps: [B] CPU tensor, the data step of the batch
            self._batch_step = int(steps[0])
            # fetched ahead before a rollback moved the data position: not trained on
            self.stale_batch = self._batch_step != self.train_state.data_step
            # with accumulation a stale batch is uncounted (with A = 1 it is a window of its
            # own, as it always was: optimizer_step drops it)
            self._uncount = self.stale_batch and self.cfg.optim.accumulate_grad_batches > 1
            return x, y
        return batch[:2]

    def on_train_batch_start(self, batch, batch_idx):
        # Randomness (dropout) is a pure function of (seed, data position, rank): a resumed,
        # replayed or rolled-back step draws exactly what it drew the first time, with no
        # RNG state to save (creating a DataLoader iterator after a restore draws from the
        # global generator, which would otherwise shift every later mask). Only the
        # generators in use are seeded: torch.manual_seed also walks every other backend.
        self.seed_dropout(self.train_state.data_step)

    def seed_dropout(self, data_step: int) -> None:
        """Dropout's generators from (seed, data position, rank) (a replay re-seeds too)."""
        if self.cfg.model.dropout > 0:
            seed = step_seed(self.cfg.seed, data_step, self.global_rank)
            torch.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                torch.cuda.manual_seed(seed)

    def training_step(self, batch, batch_idx):
        if self.stale_batch:
            # Not trained on. Returning None would skip it, but DDP forbids that (every rank
            # must join the gradient all-reduce): a zero loss is backpropagated instead, and
            # optimizer_step applies nothing.
            return self.loss(batch) * 0.0
        if self.injector is not None:
            self.injector.begin(self.train_state.model_step + 1, self.train_state.data_step)
        loss = self.loss(batch)
        if self.injector is not None:
            loss = self.injector.on_loss(self.train_state.model_step + 1, loss)
            self.injector.arm(self.train_state.model_step + 1, self.model)
        if self.micro == 0:
            self.step_loss = None  # the first micro-batch of an optimizer step
        self.micro += 1
        self.train_state.data_step = self.train_state.next_position(self.train_state.data_step + 1)
        self._batches_seen += 1
        self._loss = loss.detach()
        self.step_loss = self._loss if self.step_loss is None else self.step_loss + self._loss
        return loss

    def on_after_backward(self):
        if self.injector is not None:
            self.injector.disarm(self.model)  # then the fault's after_backward (reduced grads)

    def apply_lr(self) -> None:
        """Set every group's LR from the model's step and the remedies' scale: the one place
        the schedule is imposed (after a rollback the restored optimizer may hold an LR from
        before a lower_lr remedy)."""
        o = self.cfg.optim
        sched = self.trainer.lr_scheduler_configs[0].scheduler
        sched.base_lrs = [o.lr] * len(sched.base_lrs)
        for g in self.trainer.optimizers[0].param_groups:
            g["initial_lr"] = o.lr
            g["lr"] = o.lr * self.lr_multiplier()

    def lr_scale_now(self) -> float:
        """The remedies' LR scale at the model's step: lower_lr's factors until its healthy
        window has passed, then warming back to 1 (``rollback.remedy.lower_lr``)."""
        cfg = self.cfg.rollback.remedy.get("lower_lr")
        return lr_scale_at(
            self.train_state.lr_scale, self.train_state.lr_since, self.train_state.model_step, cfg
        )

    def lr_multiplier(self) -> float:
        """What the schedule multiplies ``optim.lr`` by at the model's step."""
        o = self.cfg.optim
        return (
            lr_factor(self.train_state.model_step, o, self.cfg.trainer.max_steps)
            * self.lr_scale_now()
        )

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        """Clip with the step's one total-norm computation (see grad_total_norm)."""
        max_norm = self.cfg.optim.grad_clip
        norm = self.grad_total_norm()
        if max_norm <= 0:
            return
        if hasattr(self.trainer.strategy.model, "clip_grad_norm_"):  # FSDP: sharded grads
            self.trainer.strategy.model.clip_grad_norm_(max_norm)
            return
        params = [p for p in self._stepped_params() if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)

    def _stepped_params(self) -> list[torch.nn.Parameter]:
        """The optimizers' parameters, whose gradients Lightning's own clipping reads: a walk
        of a few lists, where ``self.parameters()`` walks every submodule (~0.2 ms a call at
        tiny, twice a step)."""
        return [p for o in self.trainer.optimizers for g in o.param_groups for p in g["params"]]

    def grad_total_norm(self) -> torch.Tensor:
        """The pre-clip global gradient norm of this optimizer step, computed once (foreach
        path) and shared by the monitors, the clipping and the logs. A device tensor."""
        if self._grad_norm_at == self._batches_seen and self.grad_norm is not None:
            return self.grad_norm
        fsdp = getattr(self.trainer.strategy.model, "clip_grad_norm_", None)
        if fsdp is not None:  # only FSDP can see the whole of its sharded gradients
            self.grad_norm = fsdp(math.inf)  # clip at inf: just the norm
        else:
            grads = [p.grad for p in self._stepped_params() if p.grad is not None]
            self.grad_norm = (
                full_norm(torch.nn.utils.get_total_norm(grads, foreach=True))  # FSDP2: DTensor
                if grads
                else torch.zeros((), device=self.device)
            )
        self._grad_norm_at = self._batches_seen
        return self.grad_norm

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self._window_end = True  # Lightning calls this once per window (its last batch)
        if self.stale_batch:
            # Lightning wants its closure run; the stale batch's zero gradients are dropped
            # and no step is taken: no phantom step for the model, the LR or the scaler.
            optimizer_closure()
            optimizer.zero_grad(set_to_none=True)
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.micro = 0  # the next micro-batch starts the next window
        if self.train_state.skip_step:  # judged bad before it was applied: the rollback restores
            self.train_state.skip_step = False
            return
        self.train_state.model_step += 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        window_end, self._window_end = self._window_end, False
        if not window_end:  # mid-window: no optimizer step to speak of yet
            return
        last = (
            self.train_state.model_step >= self.cfg.trainer.max_steps
        )  # the final step is always logged
        if self.trainer.global_step % self.trainer.log_every_n_steps and not last:
            return
        stats = {
            "train/step": float(self.train_state.model_step),
            "train/lr": self.optimizers().param_groups[0]["lr"],
        }
        if self.step_loss is not None:
            # logged here, on log steps only: self.log costs ~1 ms per call on every step.
            # The step's loss: the mean over its micro-batches (each a mean over B x T
            # tokens, so this is the mean over the step's tokens, as one big batch gives)
            a = self.cfg.optim.accumulate_grad_batches
            stats["train/loss"] = self.step_loss if a == 1 else self.step_loss / a
        if self.grad_norm is not None:
            stats["train/grad_norm"] = self.grad_norm
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            stats["train/loss_scale"] = scaler_scale(scaler).float().reshape(())
        self.log_dict(stats, on_step=True, on_epoch=False)

    def configure_optimizers(self):
        o = self.cfg.optim
        opt = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        if o.master_dtype == "fp32":  # an fp32 master copy of 16-bit weights
            self.master = MasterWeights(opt, self.model)
            self.master.load(self._saved_master)
        if o.state_dtype == "bf16":  # a 16-bit optimizer state, emulated
            opt.register_step_post_hook(round_moments_to_bf16)
        # The LR is a function of the *model's* step, not of how often the scheduler was
        # stepped: Lightning steps it once per loop iteration, including replays after a
        # rollback, and a restored scheduler counter would drift from model_step.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: self.lr_multiplier())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints ----------------------------------------------------------------------
    def on_before_optimizer_step(self, optimizer) -> None:
        if self.master is not None:  # the step's final gradients: AdamW steps fp32 masters
            self.master.before_step()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["stabilize"] = saved_state(self)
        if self.master is not None:
            checkpoint["master_weights"] = self.master.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_state(self, checkpoint["stabilize"])
        self._saved_master = checkpoint.get("master_weights", {})
        if self.master is not None:
            self.master.load(self._saved_master)
