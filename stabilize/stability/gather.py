"""The step gather: one vector, one collective, one host transfer per optimizer step.

The probe's device statistics, the loss, the pre-clip grad norm, the loss scale and (every
``monitor.replicas.every`` steps) a fingerprint of the rank's parameters are one 1-D tensor
(the probe's buffer has ``HEAD`` lead slots for them), gathered across ranks in one
collective, reduced on device and moved to the host once, together with each rank's own
lead slots (docs/stability.md). Every rank then holds the same ``StepStats``, and the
per-rank rows (``ranks``: each rank's loss, grad norm and fingerprint) that the re-run
classification and the replica check compare.

The fingerprint is exact: the parameters' raw bits, summed as integers (int32 views of
fp32 summed in int64). One flipped bit changes one element's integer by +-2^b, so the sum
changes by 2^b (mod 2^64): any single flip is seen, whatever its bit. The int64 travels in
the fp32 vector as four 16-bit chunks (each exact in fp32).
"""

from __future__ import annotations

import torch

from stabilize.compat import found_inf_per_device, scaler_scale
from stabilize.monitors import StepStats
from stabilize.stability.probe import StabilityProbe

SCALARS = 4  # loss, grad norm, loss scale, found-inf
CHUNKS = 4  # the parameter fingerprint, an int64 as four 16-bit pieces
HEAD = SCALARS + CHUNKS  # the step vector's lead slots
_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(params) -> torch.Tensor:
    """The sum of every parameter's raw bits as integers (int64, wrapping; on device)."""
    total = None
    for p in params:
        s = p.detach().reshape(-1).view(_INTS[p.element_size()]).sum(dtype=torch.int64)
        total = s if total is None else total + s
    return total


def fingerprint_chunks(fp: torch.Tensor) -> torch.Tensor:
    """int64 -> four fp32 slots of 16 bits each, lowest first (exact)."""
    shifts = torch.arange(0, 64, 16, device=fp.device)
    return ((fp >> shifts) & 0xFFFF).float()


def join_chunks(chunks: list[float]) -> int | None:
    """Four slots back into the unsigned 64-bit fingerprint (None: not measured)."""
    if chunks[0] < 0:
        return None
    return sum(int(c) << (16 * k) for k, c in enumerate(chunks))


class StepGather:
    """Builds each optimizer step's ``StepStats``; ``accumulate``: micro-batches per step
    (the step's loss is their mean). ``ranks`` after a call: each rank's (loss, grad norm,
    fingerprint or None), from the same host transfer."""

    def __init__(self, accumulate: int = 1):
        self.accumulate = accumulate
        self._consts: tuple[torch.Tensor, ...] | None = None  # NaN, -1, fingerprint -1s
        self.ranks: list[tuple[float, float, int | None]] = []

    def _constants(self, dev):
        if self._consts is None or self._consts[0].device != dev:
            # made once (per device), never written: torch.full, not torch.tensor, so no
            # host-to-device copy (a stream sync on CUDA)
            self._consts = (
                torch.full((), float("nan"), device=dev),
                torch.full((), -1.0, device=dev),
                torch.full((CHUNKS,), -1.0, device=dev),
            )
        return self._consts

    def __call__(
        self,
        loop,
        host,
        optimizer,
        probe: StabilityProbe | None,
        replicas: bool = False,
        curvature=None,
    ) -> StepStats:
        dev = host.device
        nan, minus1, no_fp = self._constants(dev)
        scaler = loop.scaler()
        scale = scaler_scale(scaler) if scaler is not None else None
        found_inf = minus1
        if scale is not None:
            # after unscale_: the scaler will skip this step if any gradient is inf/NaN
            per_dev = found_inf_per_device(scaler, optimizer)
            if per_dev:
                found_inf = sum(v.float().sum() for v in per_dev.values()).reshape(())
        loss = host.step_loss
        if loss is not None:
            loss = loss.float() if self.accumulate == 1 else loss.float() / self.accumulate
        head = [
            loss if loss is not None else nan,
            host.grad_total_norm().float().reshape(()),
            scale.float().reshape(()) if scale is not None else minus1,
            found_inf,
        ]
        fp = fingerprint_chunks(fingerprint(host.parameters())) if replicas else no_fp
        if probe is not None:
            # -- per-block gradient norms and update/weight ratios, on log
            # steps, into the probe's own slots (they travel in the step's one vector) --
            probe.record_params(optimizer, head[1], host.clip_norm, curvature)
        return self.reduce(loop, host, head, fp, probe)

    def reduce(self, loop, host, head, fp, probe) -> StepStats:
        """``head`` (the four scalars) and ``fp`` (the fingerprint's slots) with the probe's
        buffer, across ranks, to the host once. A replay calls this with its own head."""
        dev = host.device
        if probe is not None:
            # the probe's buffer has HEAD lead slots for these: the step is one vector
            maxima, _ = probe.vector(dev)
            vec = probe.buf
            with torch.no_grad():  # out= refuses inputs that require grad
                torch.stack(head, out=vec[:SCALARS])
                vec[SCALARS:HEAD].copy_(fp)
        else:
            vec = torch.cat([torch.stack(head), fp])
            maxima = vec[:0]
        nh, nm, w = HEAD, maxima.numel(), loop.world
        if w > 1:
            out = torch.empty(w * vec.numel(), device=dev)
            torch.distributed.all_gather_into_tensor(out, vec)
            out = out.view(w, vec.numel())  # [W, K]
            # loss: the mean over ranks (NaN anywhere stays NaN); maxima: max; counts: sum;
            # then every rank's own lead slots, [W * HEAD]
            vec = torch.cat(
                [
                    out[:, :1].mean(0),
                    out[:, 1 : nh + nm].amax(0),
                    out[:, nh + nm :].sum(0),
                    out[:, :nh].reshape(-1),
                ]
            )
        else:
            vec = torch.cat([vec, vec[:nh]])
        vals = vec.cpu().tolist()  # the one host sync of the step
        rows = vals[len(vals) - w * nh :]
        self.ranks = [
            (r[0], r[1], join_chunks(r[SCALARS:nh]))
            for r in (rows[i * nh : (i + 1) * nh] for i in range(w))
        ]
        loss_v, gnorm, sc, inf = vals[:SCALARS]
        counts = vals[nh + nm : len(vals) - w * nh]
        named = probe.unpack(vals[nh : nh + nm], counts) if probe else {}
        fps = [r[2] for r in self.ranks]
        return StepStats(
            step=host.train_state.model_step + 1,
            loss=loss_v,
            grad_norm=gnorm,
            loss_scale=sc if sc >= 0 else None,
            scaler_skipped=inf > 0,
            replicas=tuple(fps) if fps[0] is not None else (),
            **named,
        )
