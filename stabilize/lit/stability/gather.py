"""The step gather: one vector, one collective, one host transfer per optimizer step.

The probe's device statistics, the loss, the pre-clip grad norm and the loss scale are one
1-D tensor (the probe's buffer has ``HEAD`` lead slots for the four scalars), gathered
across ranks in one collective, reduced on device and moved to the host once
(docs/stability.md). Every rank then holds the same ``StepStats``.
"""

from __future__ import annotations

import torch

from stabilize.lit.probe import StabilityProbe
from stabilize.monitors import StepStats

HEAD = 4  # the step vector's first slots: loss, grad norm, loss scale, found-inf


class StepGather:
    """Builds each optimizer step's ``StepStats``; ``accumulate``: micro-batches per step
    (the step's loss is their mean)."""

    def __init__(self, accumulate: int = 1):
        self.accumulate = accumulate
        self._consts: tuple[torch.Tensor, torch.Tensor] | None = None  # NaN, -1 on device

    def __call__(self, trainer, pl_module, optimizer, probe: StabilityProbe | None) -> StepStats:
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
        if probe is not None:
            # -- issue 15 item 5: per-block gradient norms and update/weight ratios, on log
            # steps, into the probe's own slots (they travel in the vector below) --
            probe.record_params(optimizer, head[1], pl_module.cfg.optim.grad_clip)
            # the probe's buffer has HEAD lead slots for these: the step is one vector
            maxima, _ = probe.vector(dev)
            vec = probe.buf
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
        named = probe.unpack(host[nh : nh + nm], host[nh + nm :]) if probe else {}
        return StepStats(
            step=pl_module.model_step + 1,
            loss=loss_v,
            grad_norm=gnorm,
            loss_scale=sc if sc >= 0 else None,
            scaler_skipped=inf > 0,
            **named,
        )
