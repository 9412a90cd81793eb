"""The run configuration's sections that are plain settings: ``optim``, ``precision``,
``trainer``, ``logger`` and ``audit`` (configs/<group>/), each a dataclass validated on
construction with the key, the value and the allowed values. ``RunConfig`` (config.py)
holds them with the sections other packages own (model, data, monitor, rollback, fault).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from stabilize.validate import ConfigError, check_choice, check_count, check_positive, check_range

# signals a cluster sends before it kills a job (trainer.preempt_signals, lit/preempt.py)
PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16-true")
SCHEDULES = ("cosine", "linear", "constant")
STRATEGIES = ("auto", "ddp", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
PROGRESS = ("auto", "rich", "plain", "none")


@dataclass
class OptimConfig:
    """``optim`` (configs/optim/): AdamW, decoupled weight decay on matrices only; linear
    warmup, then the schedule."""

    lr: float = 3e-4
    """The peak learning rate (after the warmup)."""
    weight_decay: float = 0.1
    """Decoupled (AdamW); never on norms, biases or embeddings."""
    beta1: float = 0.9
    """AdamW's decay of the gradient's running mean (first moment)."""
    beta2: float = 0.95
    """AdamW's decay of the squared gradient's running mean (second moment)."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the square root of the second moment."""
    warmup_steps: int = 100
    """Linear warmup from 0, in optimizer steps."""
    schedule: str = "cosine"
    """cosine | linear | constant, after the warmup."""
    min_lr_ratio: float = 0.1
    """The schedule's floor, as a fraction of lr."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 turns clipping off."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    state_dtype: str = "fp32"
    """fp32 | bf16: AdamW's moments stored at bf16's precision, rounded after each step
    (lit/optim_state.py): a precision site (docs/precision.md)."""
    master_dtype: str = "param"
    """param | fp32: AdamW updates the parameters in their own dtype (fp32 except under
    bf16-true, which then has no master copy), or an fp32 master copy of 16-bit parameters
    that are set from it after each step (lit/optim_state.py; its moments are fp32 then):
    a precision site under bf16-true (docs/precision.md)."""

    def __post_init__(self) -> None:
        check_positive("optim.lr", self.lr)
        check_choice("optim.state_dtype", self.state_dtype, ("fp32", "bf16"))
        check_choice("optim.master_dtype", self.master_dtype, ("param", "fp32"))
        check_range("optim.weight_decay", self.weight_decay, 0.0, 10.0)
        check_range("optim.beta1", self.beta1, 0.0, 1.0)
        check_range("optim.beta2", self.beta2, 0.0, 1.0)
        check_positive("optim.eps", self.eps)
        check_range("optim.warmup_steps", self.warmup_steps, 0, float("inf"))
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0 + 1e-9)
        check_range("optim.grad_clip", self.grad_clip, 0.0, float("inf"))
        check_positive("optim.accumulate_grad_batches", self.accumulate_grad_batches, integer=True)


@dataclass
class PrecisionConfig:
    """``precision`` (configs/precision/): the run's dtype recipe."""

    name: str = "fp32"
    """fp32 | fp16-mixed (fp32 master weights, fp16 autocast, dynamic loss scaling: real
    fp16 on CPU too) | bf16-mixed | bf16-true (weights and activations in bf16, no fp32
    master copy)."""
    init_scale: float = 2.0**16
    """fp16-mixed only: GradScaler's initial loss scale (dynamic loss scaling); unused by the
    others (bf16 needs no loss scaling)."""
    growth_interval: int = 2000
    """fp16-mixed only: steps without an inf/NaN gradient before GradScaler doubles it."""

    def __post_init__(self) -> None:
        check_choice("precision.name", self.name, PRECISIONS)
        check_positive("precision.init_scale", self.init_scale)
        check_positive("precision.growth_interval", self.growth_interval, integer=True)


@dataclass
class TrainerConfig:
    """``trainer`` (configs/trainer/): how long, how often, on what."""

    max_steps: int = 500
    """Optimizer steps; also the length of the LR schedule."""
    stop_at_step: int | None = None
    """Stop cleanly here, as if interrupted (resume=auto goes on)."""
    log_every_n_steps: int = 10
    """Every N optimizer steps: a row of metrics (CSV, W&B), the console's step line and
    the per-layer statistics of the stability probe (a log step)."""
    val_check_interval: int = 100
    """Validate every N optimizer steps."""
    limit_val_batches: int = 8
    """Held-out batches scored at each validation (0: no validation; the final eval reads
    its own, ``final_eval_batches``)."""
    checkpoint_every_n_steps: int = 100
    """A ``step-NNNNNN.ckpt`` and ``last.ckpt`` every N model steps (lit/checkpoint.py)."""
    keep_checkpoints: int = 5
    """Periodic checkpoints kept, the newest (-1: all); last.ckpt always."""
    accelerator: str = "auto"
    """auto | cpu | gpu (cuda)."""
    devices: Any = "auto"
    """An int, or "auto" (under torchrun: taken from its environment, the processes per
    node)."""
    num_nodes: int = 1
    """Nodes of the run (under torchrun: taken from its environment)."""
    strategy: str = "auto"
    """auto | ddp | fsdp."""
    deterministic: bool = False
    """Lightning's ``deterministic``: torch's deterministic algorithms only (slower)."""
    progress: str = "auto"
    """auto (rich in a terminal, plain lines otherwise) | rich | plain | none."""
    compile: bool = False
    """torch.compile the GPT (the monitors' hooks are compiled with it)."""
    activation_checkpointing: bool = False
    """Recompute each Block's forward in the backward (less memory;
    stabilize/model/recompute.py): the activations of 16 x 2048 tokens of gpt-1.3b then fit
    an 80 GB GPU, for ~1/3 more compute."""
    final_eval_batches: int | None = None
    """After training: score the whole held-out split (None), its first N batches (N), or
    not (0)."""
    final_eval_tokens: int | None = 20_000_000
    """... at most this many tokens (a 5% split of 10B tokens: not 30 min; None: no bound)."""
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that mean "preempted": finish the step, checkpoint, exit 4 (lit/preempt.py;
    SLURM --signal: add SIGUSR1)."""
    hang_timeout_s: float | None = None
    """No progress this long: the rank is named and the launch ends with exit 5
    (lit/watchdog.py); None: max(60 s, 5 x the median step); 0: no watchdog."""
    pg_timeout_s: float = 1800
    """torch.distributed's collective timeout, the backstop."""
    grad_reduce_dtype: str = "grad"
    """grad | bf16 | fp32: the dtype the gradients are all-reduced in across ranks: their
    own (fp32 under mixed precision, bf16 under bf16-true), or cast to bf16 / fp32 for the
    reduction and back (lit/grad_reduce.py): a precision site of a multi-rank run."""

    def __post_init__(self) -> None:
        if self.hang_timeout_s is not None:
            check_range("trainer.hang_timeout_s", self.hang_timeout_s, 0.0, float("inf"))
        check_positive("trainer.pg_timeout_s", self.pg_timeout_s)
        for i, name in enumerate(self.preempt_signals):
            check_choice(f"trainer.preempt_signals[{i}]", name, PREEMPT_SIGNALS)
        if self.final_eval_batches is not None:
            check_count("trainer.final_eval_batches", self.final_eval_batches)
        if self.final_eval_tokens is not None:
            check_positive("trainer.final_eval_tokens", self.final_eval_tokens, integer=True)
        for key in ("max_steps", "log_every_n_steps", "val_check_interval", "num_nodes"):
            check_positive(f"trainer.{key}", getattr(self, key), integer=True)
        check_count("trainer.limit_val_batches", self.limit_val_batches)
        check_positive(
            "trainer.checkpoint_every_n_steps", self.checkpoint_every_n_steps, integer=True
        )
        if self.stop_at_step is not None:
            check_positive("trainer.stop_at_step", self.stop_at_step, integer=True)
        if self.keep_checkpoints != -1:
            check_positive("trainer.keep_checkpoints", self.keep_checkpoints, integer=True)
        check_choice("trainer.accelerator", self.accelerator, ACCELERATORS)
        if self.devices != "auto":
            check_positive("trainer.devices", self.devices, integer=True)
        check_choice("trainer.strategy", self.strategy, STRATEGIES)
        check_choice("trainer.progress", self.progress, PROGRESS)
        check_choice("trainer.grad_reduce_dtype", self.grad_reduce_dtype, ("grad", "bf16", "fp32"))


@dataclass
class LoggerConfig:
    """``logger`` (configs/logger/): W&B (offline unless WANDB_MODE or ``mode`` say
    otherwise; ``wandb sync`` later) and a CSV log."""

    wandb: bool = True
    """Log to W&B (rank 0 only)."""
    mode: str = "offline"
    """offline | online | disabled; the WANDB_MODE variable wins when set."""
    project: str = "stabilize"
    """The W&B project."""
    entity: str | None = None
    """The W&B entity (a user or team); None: W&B's default one."""
    group: str | None = None
    """None: the experiment name, or the sweep's name under -m (a multirun)."""
    job_type: str = "train"
    """The W&B run's job type."""
    tags: list[str] = field(default_factory=list)
    """W&B tags (a scenario's arm adds ``arm:<arm>``)."""
    name: str | None = None
    """The W&B run's name; None: ``<name>-<arm>-<run dir's name>``, each part once (one a
    later part already holds is left out)."""
    csv: bool = True
    """Also a CSV log (run_dir/csv), whatever W&B does."""
    layer_panels: int = 24
    """W&B: a per-layer prefix (``act/``, ``norm_rms/``, ...) with more keys than this is
    hidden from the automatic panels and drawn as one ``layers/<prefix>`` chart, every
    layer a line, at the end of training (stability/wandb_layers.py); -1: never."""

    def __post_init__(self) -> None:
        check_choice("logger.mode", self.mode, ("offline", "online", "disabled"))
        n = self.layer_panels
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise ConfigError(f"logger.layer_panels={n!r} is not allowed; must be an integer "
                              ">= -1 (-1: never group)")  # fmt: skip

    def wandb_mode(self) -> str:
        """The mode W&B runs in: the ``WANDB_MODE`` variable wins over ``logger.mode``."""
        return os.environ.get("WANDB_MODE", self.mode)


@dataclass
class AuditConfig:
    """``audit``: norm outputs against a float64 reference on held-out batches
    (stabilize/lit/audit.py)."""

    every: int = 0
    """Every N model steps (0: only at the end of training)."""
    batches: int = 1
    """Validation batches per audit."""

    def __post_init__(self) -> None:
        check_range("audit.every", self.every, 0, float("inf"))
        check_positive("audit.batches", self.batches, integer=True)
