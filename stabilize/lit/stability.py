"""The stability callback: feeds the monitors once per step, acts on their verdict.

Per optimizer step: the probe's device statistics, the loss, the pre-clip grad norm and the
loss scale are stacked into one vector, gathered across ranks in one collective, reduced
on device and moved to the host once (docs/stability.md). Every rank then runs the same
monitors on the same numbers and takes the same decision: warn, snapshot, roll back with a
remedy, or abort with a diagnosis.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from stabilize.faults import FaultConfig, FaultInjector
from stabilize.lit.probe import StabilityProbe
from stabilize.monitors import ROLLBACK, Event, MonitorConfig, MonitorSuite, StepStats
from stabilize.numerics import sum_of_squares_rms_limit
from stabilize.rollback import (
    DurableWriter,
    RollbackConfig,
    RollbackPolicy,
    Snapshot,
    SnapshotRing,
    apply_remedy,
    to_cpu,
)

HEAD = 4  # the step vector's first slots: loss, grad norm, loss scale, found-inf


class StabilityAbort(RuntimeError):
    """Raised on every rank at once when the policy gives up; carries the diagnosis."""

    def __init__(self, diagnosis: dict[str, Any]):
        super().__init__(diagnosis["reason"])
        self.diagnosis = diagnosis


class StabilityCallback(L.Callback):
    def __init__(
        self,
        monitor: MonitorConfig,
        rollback: RollbackConfig,
        fault: FaultConfig,
        run_dir: str,
        accumulate: int = 1,
    ):
        self.mcfg, self.rcfg, self.fcfg = monitor, rollback, fault
        # without monitors nothing can call for a rollback: no snapshots to pay for either
        self.rollback_on = rollback.enabled and monitor.enabled
        self.run_dir = Path(run_dir)
        self.accumulate = accumulate
        self.suite = MonitorSuite(monitor)
        self.ring = SnapshotRing(rollback.keep)
        self.writer = DurableWriter(background=rollback.durable_async)
        self.policy = RollbackPolicy(rollback)
        self.probe: StabilityProbe | None = None
        self.injector: FaultInjector | None = None
        self.last: StepStats | None = None
        self._pending: tuple | None = None
        self._batch = None
        self._consts: tuple[torch.Tensor, torch.Tensor] | None = None  # NaN, -1 on device
        self.counts = {"warn": 0, "skip": 0, "rollback": 0}
        self._localized = False

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        model = pl_module.model
        # The fault's hook first: hooks run in registration order, and the probe must
        # measure what the next layer really receives.
        self.injector = FaultInjector(self.fcfg, rank=trainer.global_rank)
        self.injector.attach(model)
        pl_module.injector = self.injector
        if getattr(self, "_fault_state", None):  # resumed: loaded before this runs
            self.injector.load_state_dict(self._fault_state)
        if self.mcfg.enabled:
            self.probe = StabilityProbe(model, lead=HEAD)

    def on_train_start(self, trainer, pl_module):
        if self.rollback_on:
            self._snapshot(trainer, pl_module)  # a floor to return to, before any step

    def on_train_end(self, trainer, pl_module):
        self.writer.wait()  # the last durable snapshot is on disk before fit returns

    def on_exception(self, trainer, pl_module, exception):
        # an abort or a crash: the durable snapshot in flight is still written (it predates
        # the fault), then the original exception goes on
        try:
            self.writer.close()
        except Exception as e:  # noqa: BLE001  (the training error is the one to report)
            rank_zero_info(f"[stability] the durable snapshot in flight failed too: {e!r}")

    def teardown(self, trainer, pl_module, stage):
        self.writer.close()

    # ---- per step -----------------------------------------------------------------------
    # The verdict is reached in on_before_optimizer_step: gradients are unscaled and the
    # loss known, but nothing is applied yet. A bad step is then made a no-op (gradients
    # dropped, as torchtitan stops before the optimizer), so the weights the localization
    # replays and the snapshot ring never see it; the restore itself waits for
    # on_train_batch_end, after Lightning's step / scaler update / scheduler bookkeeping.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.data_step % self.accumulate == 0 and self.probe is not None:
            # this step is logged iff Lightning's step after it is a multiple of the interval
            detailed = (trainer.global_step + 1) % trainer.log_every_n_steps == 0
            self.probe.reset(detailed=detailed, device=pl_module.device)
        self._batch = batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if pl_module.stale_batch or not (self.mcfg.enabled or self.rollback_on):
            return
        stats = self._gather(trainer, pl_module, optimizer)
        events = self.suite.update(stats)
        self.last = stats
        bad = [e for e in events if e.kind == ROLLBACK]
        nonfinite = next((e for e in bad if e.monitor == "nonfinite"), None)
        # Where did it start? Every time when it is rolled back; without rollback, for the
        # first one only (a run left to go on would replay every step after it).
        if nonfinite is not None and (self.rollback_on or not self._localized):
            nonfinite.extra["localization"] = self._localize(trainer, pl_module)
            self._localized = True
        if bad and self.rollback_on:
            optimizer.zero_grad(set_to_none=True)  # nothing of this step is applied
            pl_module.skip_step = True
        self._pending = (stats, events, bad[0] if bad and self.rollback_on else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.stale_batch or self._pending is None:
            return  # a stale batch, or mid-accumulation: no optimizer step was judged
        stats, events, fault = self._pending
        self._pending = None
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self._log_stats(trainer, stats)
        for e in events:
            self._emit(trainer, e)
        if fault is not None:
            self._rollback(trainer, pl_module, fault)
        elif self.rollback_on and pl_module.model_step % self.rcfg.snapshot_every == 0:
            self._snapshot(trainer, pl_module)

    def _gather(self, trainer, pl_module, optimizer) -> StepStats:
        """One vector, one collective, one host transfer."""
        dev = pl_module.device
        if self._consts is None or self._consts[0].device != dev:
            # made once (per device), never written: torch.full, not torch.tensor, so no
            # host-to-device copy (a stream sync on CUDA)
            self._consts = tuple(torch.full((), v, device=dev) for v in (float("nan"), -1.0))
        nan, minus1 = self._consts
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        found_inf = minus1
        if scale is not None:
            # after unscale_: the scaler will skip this step if any gradient is inf/NaN
            per_dev = scaler._found_inf_per_device(optimizer)
            if per_dev:
                found_inf = sum(v.float().sum() for v in per_dev.values()).reshape(())
        loss = pl_module.step_loss
        if loss is not None:
            loss = loss.float() if self.accumulate == 1 else loss.float() / self.accumulate
        head = [
            loss if loss is not None else nan,
            pl_module.grad_total_norm().float().reshape(()),
            scale.float().reshape(()) if scale is not None else minus1,
            found_inf,
        ]
        nh = HEAD
        if self.probe is not None:
            # the probe's buffer has HEAD lead slots for these: the step is one vector
            maxima, _ = self.probe.vector(dev)
            vec = self.probe.buf
            with torch.no_grad():  # out= refuses inputs that require grad
                torch.stack(head, out=vec[:nh])
        else:
            vec = torch.stack(head)
            maxima = vec[:0]
        nm = maxima.numel()
        if trainer.world_size > 1:
            out = torch.empty(trainer.world_size * vec.numel(), device=dev)
            torch.distributed.all_gather_into_tensor(out, vec)
            out = out.view(trainer.world_size, vec.numel())  # [W, K]
            # loss: the mean over ranks (NaN anywhere stays NaN); maxima: max; counts: sum
            vec = torch.cat(
                [out[:, :1].mean(0), out[:, 1 : nh + nm].amax(0), out[:, nh + nm :].sum(0)]
            )
        host = vec.cpu().tolist()  # the one host sync of the step
        loss_v, gnorm, sc, inf = host[:nh]
        named = self.probe.unpack(host[nh : nh + nm], host[nh + nm :]) if self.probe else {}
        return StepStats(
            step=pl_module.model_step + 1,
            loss=loss_v,
            grad_norm=gnorm,
            loss_scale=sc if sc >= 0 else None,
            scaler_skipped=inf > 0,
            **named,
        )

    def _localize(self, trainer, pl_module) -> list[dict[str, Any]]:
        """Replay this step's forward (weights not yet updated) with a hook on every module;
        report the first module, in execution order, whose output was non-finite, and
        whether its input already was. Only on a NaN event: healthy steps pay nothing."""
        model = pl_module.model
        names = {m: n for n, m in model.named_modules()}
        first: dict[str, Any] = {}

        def finite(t):
            ts = (
                [t]
                if isinstance(t, torch.Tensor)
                else [x for x in t if isinstance(x, torch.Tensor)]
            )
            return all(bool(torch.isfinite(x).all()) for x in ts if x.is_floating_point())

        def hook(module, args, out):
            if not first and not finite(out):
                first.update(module=names[module] or "model", input_finite=finite(args))

        handles = [m.register_forward_hook(hook) for m in model.modules()]
        try:
            x, _y = self._batch
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                model(x)
        finally:
            for h in handles:
                h.remove()
        mine = first or {
            "module": None,
            "note": "the forward was finite: the non-finite value arose in the loss or after it",
        }
        mine["rank"] = trainer.global_rank
        if trainer.world_size == 1:
            return [mine]
        every: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(every, mine)
        return every

    # ---- logging ------------------------------------------------------------------------
    def _log_stats(self, trainer, s: StepStats) -> None:
        m: dict[str, float] = {"train/step": float(s.step)}
        m.update({f"act/{k}": v for k, v in s.act_max.items()})
        m.update({f"attn_logit/{k}": v for k, v in s.attn_logit.items()})
        m.update({f"overflow/{k}": v for k, v in s.norm_overflow.items()})
        m.update({f"dead/{k}": v for k, v in s.norm_collapsed.items()})
        m.update({f"rms/{k}": v for k, v in s.norm_rms_max.items()})
        # fp16 sum-of-squares headroom: how far each row RMS may still grow before the sum
        # over D elements passes 65504 (< 1: it already overflows), for norms whose RMS
        # is measured (the explicit backend, i.e. 16-bit reductions)
        if self.probe is not None:
            m.update(
                {
                    f"headroom/{k}": sum_of_squares_rms_limit(torch.float16, self.probe.dims[k]) / v
                    for k, v in s.norm_rms_max.items()
                    if v > 0
                }
            )
        m.update({f"forecast/{k}": min(v, 1e6) for k, v in self.suite.forecast.items()})
        m.update({f"stability/{k}s": float(v) for k, v in self.counts.items()})
        m = {k: v for k, v in m.items() if math.isfinite(v)}
        # Host floats, straight to the loggers (rank 0): self.log's per-key bookkeeping
        # cost ~10 ms per log step for the per-layer series.
        if trainer.is_global_zero:
            # the step Lightning's own self.log rows use at this point (one less than
            # global_step), so per-layer rows line up with train/loss in CSV and W&B
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for lg in trainer.loggers:
                lg.log_metrics(m, step=step)

    def _emit(self, trainer, e: Event, **extra) -> None:
        if e.kind in self.counts:
            self.counts[e.kind] += 1
        if not trainer.is_global_zero:
            return
        record = {**e.to_dict(), "global_step": trainer.global_step, **extra}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if e.kind != "info":
            rank_zero_info(f"[stability] {e.kind.upper()} step {e.step}: {e.message}")
        if e.kind in ("warn", "rollback", "abort"):
            for lg in trainer.loggers:
                if isinstance(lg, WandbLogger):
                    level = "WARN" if e.kind in ("warn", "skip") else "ERROR"
                    lg.experiment.alert(
                        title=f"{e.kind}: {e.monitor}", text=e.message, level=level, wait_duration=0
                    )

    # ---- snapshots and rollback -----------------------------------------------------------
    def _objects(self, trainer):
        opt = trainer.optimizers[0]
        sched = trainer.lr_scheduler_configs[0].scheduler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        return opt, sched, scaler

    def _snapshot(self, trainer, pl_module) -> None:
        opt, sched, scaler = self._objects(trainer)
        # the host buffers of the snapshot leaving the ring are written in place (copy_):
        # no allocation once the ring is full (stabilize.rollback.SnapshotRing)
        old = self.ring.recycle() or {}
        if self.writer.busy_with(old):  # still being written to disk: let it finish first
            self.writer.wait()
        state = {
            "model": to_cpu(pl_module.model.state_dict(), old.get("model")),
            "optimizer": to_cpu(opt.state_dict(), old.get("optimizer")),
            "scheduler": to_cpu(sched.state_dict()),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "model_step": pl_module.model_step,
            "data_step": pl_module.data_step,
            "monitors": to_cpu(self.suite.state_dict()),
            "fault": self.injector.snapshot_state() if self.injector else None,
        }
        snap = Snapshot(pl_module.model_step, state)
        self.ring.push(snap)
        every = self.rcfg.durable_every
        if every and snap.step % every == 0 and trainer.is_global_zero:
            self.writer.submit(snap, self.run_dir / "snapshots")

    def restore(self, trainer, pl_module, st: dict) -> None:
        """Load a snapshot's state into the live model, optimizer, scheduler, scaler and
        monitors (no remedy, no data seek: that is _rollback's business)."""
        opt, sched, scaler = self._objects(trainer)
        pl_module.model.load_state_dict(st["model"])  # copies into the parameters
        opt.load_state_dict(st["optimizer"])
        # Optimizer.load_state_dict keeps the snapshot's own tensors wherever no cast or
        # move is needed (every ``step`` counter; on CPU the moments too): the optimizer
        # would then update the snapshot in place, and a second rollback to it, or the
        # next snapshot written into its recycled buffers, would see the live state.
        for per_param in opt.state.values():
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    per_param[k] = v.clone()
        sched.load_state_dict(st["scheduler"])
        if scaler is not None and st["scaler"] is not None:
            scaler.load_state_dict(st["scaler"])
        self.suite.load_state_dict(st["monitors"])

    def _rollback(self, trainer, pl_module, event: Event) -> None:
        decision = self.policy.decide(event, self.ring)
        if decision.action == "abort":
            self._abort(trainer, pl_module, event, decision.reason)
        snap, remedy = decision.snapshot, decision.remedy
        st = snap.state
        self.restore(trainer, pl_module, st)
        if self.injector is not None and st["fault"] is not None:
            self.injector.on_rollback(st["fault"])
        pl_module.model_step, pl_module.data_step = st["model_step"], st["data_step"]
        did = apply_remedy(remedy, pl_module.model, self.rcfg)
        if remedy == "skip_data":
            pl_module.data_step += self.rcfg.skip_batches
        elif remedy == "lower_lr":
            pl_module.lr_scale *= self.rcfg.lr_factor
        pl_module.apply_lr()  # remedies so far stay applied, on the restored step
        pl_module.remedies.append(remedy)
        pl_module.seek_data(pl_module.data_step)
        trainer.optimizers[0].zero_grad(set_to_none=True)
        self.ring.drop_after(snap.step)
        self._emit(
            trainer,
            Event(
                "rollback",
                "rollback",
                event.step,
                f"rolled back from step {event.step} to {snap.step} "
                f"({event.monitor}); remedy {remedy}: {did}",
                layer=event.layer,
                extra={"restored_step": snap.step, "remedy": remedy, **did},
            ),
        )

    def _abort(self, trainer, pl_module, event: Event, reason: str) -> None:
        s = self.last
        top = sorted(s.act_max.items(), key=lambda kv: -kv[1])[:5] if s else []
        forecast = {k: v for k, v in self.suite.forecast.items() if math.isfinite(v)}
        diagnosis = {
            "reason": reason,
            "monitor": event.monitor,
            "step": event.step,
            "layer": event.layer,
            "message": event.message,
            "act_max_top": top,
            "forecast_steps_left": dict(sorted(forecast.items(), key=lambda kv: kv[1])[:5]),
            "rollbacks": self.policy.history,
            "remedies": list(pl_module.remedies),
        }
        self._emit(
            trainer,
            Event(
                "abort",
                "rollback",
                event.step,
                f"abort: {reason}",
                layer=event.layer,
                extra={"diagnosis": diagnosis},
            ),
        )
        if trainer.is_global_zero:
            (self.run_dir / "diagnosis.json").write_text(
                json.dumps(diagnosis, indent=2, default=str)
            )
        raise StabilityAbort(diagnosis)

    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: a resumed run keeps its monitors' windows, its
        rollback history (the ladder) and its fault's course."""
        return {
            "monitors": self.suite.state_dict(),
            "policy": self.policy.state_dict(),
            "counts": dict(self.counts),
            "fault": self.injector.state_dict() if self.injector else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.suite.load_state_dict(state["monitors"])
        self.policy.load_state_dict(state["policy"])
        self.counts.update(state["counts"])
        self._fault_state = state.get("fault")
        if self.injector is not None and self._fault_state:  # Lightning restores after setup
            self.injector.load_state_dict(self._fault_state)
