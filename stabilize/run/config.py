"""The typed run configuration: what train.py turns Hydra's DictConfig into.

Rule of the house: Hydra stops in train.py. Everything below it receives these dataclasses,
each validated on construction with the key, the value and the allowed values. ``RunConfig``
holds one section per group and the cross-section rules; the plain sections (``optim``,
``precision``, ``trainer``, ``logger``, ``audit``) are defined in sections.py and importable
from here too; a saved config of an older version loads through ``RunConfig.from_saved``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from stabilize.data import DEFAULT_TOKENIZER, DataConfig, choose_tokenizer, follow_vocab
from stabilize.faults import FaultConfig, fault_config
from stabilize.model import GPTConfig
from stabilize.model.config import PRESETS
from stabilize.monitors import MonitorConfig
from stabilize.monitors.activations import nest_forecast_keys, resolve_line
from stabilize.norms import NormConfig
from stabilize.quant.config import QuantConfig, check_with_norms
from stabilize.rollback import RollbackConfig
from stabilize.rollback.quant_remedies import QUANT_RUNGS
from stabilize.run.rundir import check_name
from stabilize.run.sections import (
    PRECISIONS,
    AuditConfig,
    LoggerConfig,
    OptimConfig,
    PrecisionConfig,
    TrainerConfig,
)
from stabilize.validate import (
    ConfigError,
    build_dataclass,
)

__all__ = [
    "PRECISIONS",
    "AuditConfig",
    "LoggerConfig",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainerConfig",
    "check_vocab",
]

# Settings a saved config may hold that this version no longer has: (section, key). They
# changed no decision (a warning's wording), so an old repro bundle replays without them.
RETIRED = (("monitor.activation", "forecast_slowing"),)  # now forecast.slow_steps


def check_vocab(vocab_size: int, tokenizer_vocab: int, tokenizer: str) -> None:
    """``model.vocab_size`` holds every id of the tokenizer (ids 0 .. tokenizer_vocab - 1)."""
    if vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is not allowed with the {tokenizer!r} tokenizer "
            f"(ids 0 .. {tokenizer_vocab - 1}); allowed: >= {tokenizer_vocab}"
        )


@dataclass
class RunConfig:
    """The whole run: configs/train.yaml's own keys, and one section per group."""

    name: str = "default"
    """The experiment's name: the W&B group by default."""
    arm: str | None = None
    """A scenario's variant, set by configs/arm/*: the run's arm in a scenario (reports,
    W&B)."""
    run_dir: str = "runs/default"
    """Where the run writes (the CLI: Hydra's run dir, runs/<name>/<run id>)."""
    resume: str = "none"
    """none | auto (the newest intact checkpoint) | restart | path/to.ckpt."""
    resume_trusted: bool = False
    """True: unpickle the resume checkpoint fully (it could run code; stabilize/trust.py)."""
    seed: int = 1234
    """Seeds the start (the model's init: ``seed_everything``) and each step's dropout (with
    the data position and the rank); the shipped data configs' ``data.seed`` follows it."""
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    verbose: bool = False
    """True: also third-party notices (stabilize/run/quiet.py) and Lightning's model
    summary."""

    def __post_init__(self) -> None:
        check_name(self.name)
        for key in ("verbose", "resume_trusted"):
            if not isinstance(getattr(self, key), bool):
                value = getattr(self, key)
                raise ConfigError(f"{key}={value!r} is not allowed; allowed: true, false")
        self.model = build_dataclass(GPTConfig, self.model, "model")
        for key, cls in (
            ("data", DataConfig),
            ("optim", OptimConfig),
            ("precision", PrecisionConfig),
            ("trainer", TrainerConfig),
            ("logger", LoggerConfig),
            ("rollback", RollbackConfig),
            ("audit", AuditConfig),
            ("quant", QuantConfig),
        ):
            setattr(self, key, build_dataclass(cls, getattr(self, key), key))
        # the dataclass of the kind ``fault.kind`` names: its knobs only
        self.fault = fault_config(self.fault)
        # one section per registered monitor (stabilize/monitors/registry.py), not a dataclass
        self.monitor = MonitorConfig.build(self.monitor, "monitor")
        # the |x| line follows the run's precision and reduction
        if "activation" in self.monitor.sections:
            act = self.monitor.sections["activation"]
            red = self.model.norm.reduction_dtype
            self.monitor.sections["activation"] = resolve_line(act, self.precision.name, red)

        drift = self.fault.enabled and self.fault.kind in ("activation_drift", "stream_drift")
        if drift and not 0 <= self.fault.layer < self.model.n_layer:
            raise ConfigError(
                f"fault.layer={self.fault.layer} is not allowed with model.n_layer="
                f"{self.model.n_layer}; allowed: 0 .. {self.model.n_layer - 1}"
            )
        if self.trainer.compile and drift:
            raise ConfigError(
                f"trainer.compile=true is not allowed with fault.kind={self.fault.kind!r} (its "
                "factor changes every step and would recompile the model every step)"
            )
        if self.optim.master_dtype == "fp32" and self.trainer.strategy == "fsdp":
            raise ConfigError(
                "optim.master_dtype='fp32' is not allowed with trainer.strategy='fsdp' (fp32 "
                "masters of sharded weights are not built; precision=bf16-mixed keeps the "
                "sharded parameters in fp32); allowed with: auto, ddp"
            )
        red = self.model.norm.reduction_dtype
        check_with_norms(self.quant, red)
        if self.quant.enabled:  # the rungs that change a clipping GEMM (quant_remedies.py)
            ladder = self.rollback.ladder
            ladder += [r for r in QUANT_RUNGS if r not in ladder]
        sixteen = red in ("bf16", "fp16") or (red == "input" and self.precision.name == "bf16-true")
        if self.trainer.compile and sixteen:
            raise ConfigError(
                f"trainer.compile=true is not allowed with norm.reduction_dtype={red!r} "
                f"(precision={self.precision.name!r}): inductor computes 16-bit math in fp32, "
                f"so the reduction would silently not be 16-bit; allowed with compile: "
                f"['fp32', 'input' with fp32 activations]"
            )
        self._check_fault_fires()
        self._check_vocab()

    def _check_fault_fires(self) -> None:
        """A fault drill that cannot fire is refused, not silently skipped:
        its step must be one the run reaches. (The rank is checked against the world size
        at start-up, ``run/preflight.py``; the parameter against the model's names there.)"""
        armed = self.fault.enabled and self.fault.kind != "none"
        if armed and self.fault.step > self.trainer.max_steps:
            raise ConfigError(
                f"fault.step={self.fault.step} is not allowed with trainer.max_steps="
                f"{self.trainer.max_steps} (the fault would never fire); allowed: 1 .. "
                f"{self.trainer.max_steps}"
            )

    def tokenizer_name(self) -> str:
        """The tokenizer the data pipeline encodes with (a ``data.tokenizer`` setting, when
        the data config has one; the byte tokenizer otherwise)."""
        return getattr(self.data, "tokenizer", None) or DEFAULT_TOKENIZER

    def _check_vocab(self) -> None:
        """Every token id must be an embedding row (else an IndexError at the first forward).
        ``model.vocab_size`` left at its preset's value follows ``data.tokenizer``
        (``stabilize.data.follow_vocab``); otherwise it must hold the tokenizer's ids, refused
        here, before anything is written, naming both numbers (``check_vocab``)."""
        tok_vocab = choose_tokenizer(self.data).vocab_size
        preset = PRESETS.get(self.model.name, {}).get("vocab_size", GPTConfig.vocab_size)
        vocab = follow_vocab(self.data, self.model.vocab_size, preset, tok_vocab)
        if vocab != self.model.vocab_size:
            self.model = replace(self.model, vocab_size=vocab)
        check_vocab(self.model.vocab_size, tok_vocab, self.tokenizer_name())

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """From a plain (resolved) mapping whose ``norm`` sits at the top level, as in the
        Hydra config: it is moved into ``model.norm``."""
        values = dict(values)
        allowed = list(cls.__dataclass_fields__) + ["norm"]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a known setting; allowed: {allowed}")
        if "norm" in values:
            model = dict(values.get("model") or {})
            model["norm"] = build_dataclass(NormConfig, values.pop("norm"), "norm")
            values["model"] = model
        return cls(**values)

    @classmethod
    def from_saved(cls, values: dict[str, Any]) -> RunConfig:
        """``from_dict`` for a config an older version wrote (a repro bundle's, a run dir's):
        the settings it has since retired (``RETIRED``) are dropped first, and the activation
        forecast's flat keys (``monitor.activation.horizon``, ``forecast_z``, ...) moved into
        ``monitor.activation.forecast`` (``nest_forecast_keys``)."""
        values = copy.deepcopy(values)
        for section, key in RETIRED:
            parent, _, child = section.partition(".")
            node = values.get(parent)
            node = node.get(child) if isinstance(node, dict) and child else node
            if isinstance(node, dict):
                node.pop(key, None)
        monitor = values.get("monitor")
        if isinstance(monitor, dict) and isinstance(monitor.get("activation"), dict):
            monitor["activation"] = nest_forecast_keys(monitor["activation"])
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """The full resolved config, ``norm`` at the top level again (for loggers)."""
        d = asdict(self)
        d["norm"] = d["model"].pop("norm")
        d["monitor"] = self.monitor.to_dict()
        # plain dicts: a checkpoint holds this, and Lightning loads it with weights_only
        d["rollback"]["remedy"] = dict(d["rollback"]["remedy"])
        return d
