"""Norm audit: what each norm really outputs, against a float64 reference, on held-out data.

The precision a run pays for its norms is invisible in the loss until it is not. Every
``audit.every`` model steps (and at the end of training) rank 0 runs the first
``audit.batches`` validation batches through the model, eval mode, under the run's own
autocast, with a hook on every ``Norm``, and measures per norm, per token (row):

- ``rel_err``: ||y - y64|| / ||y64||, where y is the norm's real output and y64 the same
  norm computed in float64 from the same input, with the same gamma/beta (written out here,
  not taken from stabilize.norms). bf16 rounds outputs at 2^-9 relative; fp16 at 2^-12; an
  overflowed fp16 reduction gives a zero row, i.e. an error of 1.
- ``norm_dev_median``: the median over live rows of |normalized output norm / sqrt(D) - 1|
  (gamma/beta at init, as for ``flattened``); ``norm_dev_worst`` is the largest per norm.
- ``dead``: finite, non-zero input rows whose output is all zeros (the overflow's victims).
- ``flattened``: rows whose *normalized* output (gamma/beta at their init: 1 and 0, ScaleNorm
  g = sqrt(D)) has a norm more than 5% away from sqrt(D). That happens when eps is not
  negligible against the row's mean square: the cost of a large eps (tokens of small norm
  are scaled down instead of normalized). Dead rows are counted as dead, not here.

Records go to ``audit.jsonl`` in the run dir and, as ``audit/*`` scalars, to the loggers.
The audit's forward leaves the training state alone (no gradients, eval mode restored, the
probe resets before the next step), and costs one extra forward every ``every`` steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import torch

from stabilize.compat import batches_that_stepped
from stabilize.lit.fsdp import is_sharded
from stabilize.norms import Norm, get_norm_type
from stabilize.run.config import AuditConfig

FLAT_TOLERANCE = 0.05  # |output norm / sqrt(D) - 1| above this: flattened


def reference64(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    """The norm in float64, from its type's definition (``NormType.reference64``: Ba et al.
    2016; Zhang & Sennrich 2019; Nguyen & Salazar 2019), eps inside the square root as every
    implementation here does; then gamma and beta in float64."""
    y = get_norm_type(norm.kind).reference64(x.double(), norm.eps)
    if norm.weight is not None:
        y = y * norm.weight.double()
    if norm.bias is not None:
        y = y + norm.bias.double()
    return y


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # [..., D] -> [N, D]


class NormAudit(L.Callback):
    def __init__(self, cfg: AuditConfig, run_dir: str):
        self.cfg = cfg
        self.path = Path(run_dir) / "audit.jsonl"
        self._done: set[int] = set()  # model steps audited in this launch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Once per model step: a rollback rewinds the model step to its snapshot's, whose
        # state (weights restored) was audited already, and a rollback to step 0 would add
        # an audit of the initial weights that a run without rollback never has.
        step = pl_module.train_state.model_step
        if self.cfg.every and step > 0 and step % self.cfg.every == 0 and step not in self._done:
            self.audit(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if pl_module.train_state.model_step not in self._done:
            self.audit(trainer, pl_module)

    @torch.no_grad()
    def measure(self, trainer, pl_module) -> dict[str, dict[str, float]]:
        """Per norm: rows, dead, flattened, median / max relative error, smallest input RMS."""
        model = pl_module.model
        norms = {n: m for n, m in model.named_modules() if isinstance(m, Norm)}
        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in norms}
        names = {m: n for n, m in norms.items()}

        def hook(module, args, out):
            seen[names[module]].append((args[0].detach(), out.detach()))

        handles = [m.register_forward_hook(hook) for m in norms.values()]
        was_training = model.training
        model.eval()
        ctx = trainer.precision_plugin.forward_context
        try:
            xs = [b[0].to(pl_module.device) for b in pl_module.held_out_batches(self.cfg.batches)]
            for x in xs:
                with ctx():
                    model(x)
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        out: dict[str, dict[str, float]] = {}
        for name, pairs in seen.items():
            norm = norms[name]
            if not pairs:
                continue
            xin = torch.cat([_rows(a) for a, _ in pairs])  # [N, D]
            y = torch.cat([_rows(o) for _, o in pairs]).double()  # [N, D]
            ref = reference64(norm, xin)
            err = (y - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)  # [N]
            finite_in = torch.isfinite(xin).all(-1) & (xin != 0).any(-1)
            dead = finite_in & (y == 0).all(-1)
            # the normalized output: the same module, its gamma/beta at their init values
            saved = [p.detach().clone() for p in (norm.weight, norm.bias) if p is not None]
            norm.reset_parameters()
            try:
                with ctx():
                    unit = torch.cat([_rows(norm(a)) for a, _ in pairs]).double()
            finally:
                live = [p for p in (norm.weight, norm.bias) if p is not None]
                for p, v in zip(live, saved, strict=True):
                    p.copy_(v)
            ratio = unit.norm(dim=-1) / math.sqrt(norm.dim)
            dev = (ratio - 1).abs()  # [N]
            flat = finite_in & ~dead & (dev > FLAT_TOLERANCE)
            live_rows = finite_in & ~dead & torch.isfinite(dev)
            rms = xin.double().pow(2).mean(-1).sqrt()
            ok = torch.isfinite(err)
            out[name] = {
                "rows": float(xin.shape[0]),
                "dead": float(dead.sum()),
                "flattened": float(flat.sum()),
                # how far a live row's normalized output is from norm sqrt(D): eps's bias
                "norm_dev_median": float(dev[live_rows].median()) if live_rows.any() else math.nan,
                "rel_err_median": float(err[ok].median()) if ok.any() else math.nan,
                "rel_err_max": float(err[ok].max()) if ok.any() else math.nan,
                "nonfinite": float((~torch.isfinite(y).all(-1)).sum()),
                "rms_min": float(rms[torch.isfinite(rms)].min()) if finite_in.any() else 0.0,
            }
        return out

    def audit(self, trainer, pl_module) -> dict | None:
        self._done.add(pl_module.train_state.model_step)
        # rank 0 alone cannot run a sharded model's forward (each block all-gathers its
        # parameters from every rank), nor call a norm whose gamma is a shard: not audited
        if not trainer.is_global_zero or is_sharded(pl_module.model):
            return None
        per_norm = self.measure(trainer, pl_module)
        if not per_norm:  # no held-out batch (trainer.limit_val_batches=0): nothing measured
            return None
        rows = sum(v["rows"] for v in per_norm.values())
        medians = [
            v["rel_err_median"] for v in per_norm.values() if math.isfinite(v["rel_err_median"])
        ]
        devs = [v["norm_dev_median"] for v in per_norm.values()]
        devs = [d for d in devs if math.isfinite(d)]
        summary = {
            "rel_err_median": float(sorted(medians)[len(medians) // 2]) if medians else math.nan,
            # the worst norm's median |output norm / sqrt(D) - 1| (eps's bias where it bites)
            "norm_dev_worst": max(devs) if devs else math.nan,
            "rel_err_max": max((v["rel_err_max"] for v in per_norm.values()), default=math.nan),
            "dead_share": sum(v["dead"] for v in per_norm.values()) / rows,
            "flattened_share": sum(v["flattened"] for v in per_norm.values()) / rows,
            "nonfinite_share": sum(v["nonfinite"] for v in per_norm.values()) / rows,
        }
        record = {
            "step": pl_module.train_state.model_step,
            "global_step": trainer.global_step,
            **summary,
            "norms": per_norm,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        metrics = {f"audit/{k}": v for k, v in summary.items() if math.isfinite(v)}
        step = batches_that_stepped(trainer)
        for lg in trainer.loggers:
            lg.log_metrics(metrics, step=step)
        return record
