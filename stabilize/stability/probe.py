"""Per-layer statistics gathered on device during the training forward, no host sync.

Series, in a fixed order (so every rank stacks the same vector):
- ``h.{i}``: the residual stream after block i, |x| max;
- every norm by module name (``h.{i}.ln_1``, ``ln_f``, ...): its input's |x| max, rows
  whose reduction overflowed, rows that collapsed to zeros (dead), rows whose input is not
  finite in the reduction dtype (their output is NaN), largest row RMS (all but the first
  for the explicit backend, the one whose reduction can overflow; the norm hands its input
  and statistic to ``record_norm`` from its own forward);
- ``h.{i}.attn``: an upper bound on the attention logit, max|q| max|k| / sqrt(d_head) (or
  times the attention's own scale), per head (Cauchy-Schwarz; the exact max would cost a
  second attention), from q and k as the scores see them up to a rotation, on detailed steps;
- ``h.{i}.attn``, on logged steps: the lowest head entropy, from one sequence's attention
  probabilities at strided query rows (param_stats.lowest_head_entropy);
- the output logits' log Z (max, and sum + token count for the mean), every step;
- per block ``h.{i}`` (and ``other``: embeddings, final norm), on logged steps: the gradient
  norm and the update/weight ratio of the coming optimizer step (``record_params``);
- per quantized Linear (torchao's ``Float8Linear``), on logged steps: its GEMM operands'
  headroom in their 8-bit format (quant_sites.py).

Everything lands in one preallocated fp32 device buffer, laid out as
``[lead | block max | attn bound | norm |x| max | norm RMS max | -entropy | log Z max |
grad norm | update ratio | overflow rows | collapsed rows | NaN rows | log Z sum, count]``,
where ``lead`` slots are the caller's (the stability callback writes the step's
loss, grad norm, loss scale and found-inf flag there: the whole step is then one vector):
maxima fold in with max (NaN wins), counts with +, across the micro-batches of one optimizer
step; ``reset()`` starts the next step. A slot nothing wrote is not measured, never a zero:
maxima start at -inf (or -1) and ``unpack`` leaves such a series out. On CPU the |x| max is
one pass of a C++ kernel (``stabilize.cpu_kernels.absmax_into``) written straight into its
slot, and the attention bound's per-head q and k norms one pass each (``head_norm_max``,
strided views read in place).

One tensor, one unit: a block whose output *is* the next norm's input (pre-norm) is read
once, by the norm, and judged once (readout.py ``Units``: found by identity on a model we
did not build).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from stabilize.cpu_kernels import absmax_into, head_norm_max
from stabilize.model.recompute import recomputing
from stabilize.norms import get_norm_type
from stabilize.stability.param_stats import (
    block_grad_update_norms,
    lowest_head_entropy,
    param_groups_by_block,
    sampled_queries,
)
from stabilize.stability.quant_sites import PER_SITE, attach, find_quantized
from stabilize.stability.readout import Units, unpack
from stabilize.stability.view import ModelView, view_of


class StabilityProbe:
    # Series measured on detailed steps only (``reset(detailed=...)``): the log steps, or
    # every step when a monitor declares it among its ``needs``.
    DETAILED_ONLY = frozenset({"attn_logit"})
    # The per-norm counts after the maxima, in buffer order (StepStats fields)
    COUNTS = ("norm_overflow", "norm_collapsed", "norm_nan_rows")
    # The whole model's optimizer series (StepStats.opt; the curvature every few log steps,
    # stability/curvature.py): -1 / -inf where not measured
    OPT = ("update_ratio", "g2_v", "curv_u", "curv_pre")

    def __init__(self, model: nn.Module | ModelView, lead: int = 0):
        view = model if isinstance(model, ModelView) else view_of(model)
        self.view, self.model = view, view.module
        model = view.module
        self.lead = lead
        self.blocks = [name for name, _ in view.blocks]
        self.norms = [s.name for s in view.norms]
        self.attn = [a.name if a is not None else f"{b}.attn" for (b, _), a in
                     zip(view.blocks, view.attn, strict=True)]  # fmt: skip
        nb, na, nn_ = len(self.blocks), len(self.attn), len(self.norms)
        # the per-block parameter groups of the gradient / update norms (param_stats.py)
        self.param_groups, self._param_index = param_groups_by_block(model, view)
        ng = len(self.param_groups)
        o = lead
        self._o_block, self._o_attn = o, o + nb
        self._o_norm, self._o_rms = o + nb + na, o + nb + na + nn_
        o += nb + na + 2 * nn_
        # minus each block's lowest head entropy (a max slot: max folds to the
        # minimum), the output log Z max, per-group gradient norm, update/weight ratio and
        # mean g^2 / v_hat, then the optimizer's whole-model series (OPT)
        self._o_ent, self._o_lz, self._o_gn, self._o_upd = o, o + na, o + na + 1, o + na + 1 + ng
        self._o_g2v, self._o_opt = o + na + 1 + 2 * ng, o + na + 1 + 3 * ng
        o += na + 1 + 3 * ng + len(self.OPT)
        # the quantized GEMMs' operands, six max slots each (quant_sites.py)
        self.quant = find_quantized(model)
        self.quant_always = False  # the quant series on every step (a monitor reads them)
        self._o_q = o
        o += len(self.quant) * PER_SITE
        self.n_maxima = o - lead
        self._o_over, self._o_dead, self._o_nan = (o + k * nn_ for k in (0, 1, 2))
        self._o_lzsum = o + 3 * nn_  # log Z summed over tokens, and the token count (summed)
        self._param_idx: torch.Tensor | None = None  # _param_index on the buffer's device
        self.logged = False  # entropy and parameter statistics on this step (reset)
        self._qs: list[torch.Tensor | None] = [None] * na  # one sequence's sampled queries
        self.buf: torch.Tensor | None = None  # allocated on the model's device by reset()
        self._fresh: torch.Tensor | None = None  # what reset() copies in
        self._q: list[torch.Tensor | None] = [None] * na
        self._handles: list = []
        self._attn_handles: list = []  # only on detailed steps (see reset)
        # the final logits' log Z, every training micro-batch: our loss hands it over
        # (model.logits.lm_loss's sink), read off its own log-softmax
        view.attach_sink(self)
        self.measure_log_z = True  # off: not recorded (scripts/bench_logits.py toggles it)
        self.detailed = False
        # A block whose output is exactly the input of the next norm, which the norm
        # already measures (view.aliases, or found at the first forward: readout.Units):
        # reading the same tensor twice would only cost another pass, and judging it
        # twice would warn twice.
        self.units = Units(view.aliases, self.norms)
        self.units.hook_blocks(view.blocks, self._block_hook)
        self.dims = {s.name: s.width for s in view.norms}
        self._norm_modules = [s.module for s in view.norms if s.reports]
        for j, site in enumerate(view.norms):
            if site.reports:
                site.module.stats_sink, site.module.stats_index = self, j
            else:  # a norm we did not build: its input, read by a pre-hook
                self._handles.append(site.module.register_forward_pre_hook(self._norm_hook(j)))
        self._handles += attach(self, self.quant, self._o_q)

    # ---- the step's buffer ------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Slots in the buffer, the caller's lead included."""
        return self.lead + self.n_maxima + len(self.COUNTS) * len(self.norms) + 2

    def _allocate(self, device) -> None:
        self.buf = torch.zeros(self.size, device=device)
        self._fresh = torch.zeros(self.size, device=device)
        # |x| max and the attention bound: -inf until measured (a block or norm that did not
        # run, a block whose heads were not found), left out by unpack
        self._fresh[self._o_block : self._o_rms] = -math.inf
        # RMS -1: not measured (the fused and torch backends reduce in fp32 and report none)
        self._fresh[self._o_rms : self._o_ent] = -1.0
        # not measured: entropy and log Z max -inf, the parameter norms -1 (unpack drops them)
        self._fresh[self._o_ent : self._o_gn] = -math.inf
        self._fresh[self._o_gn : self._o_over] = -1.0
        self._fresh[self._o_opt + 2 : self._o_over] = -math.inf  # a curvature may be < 0

    def reset(self, detailed: bool = True, device=None, logged: bool | None = None) -> None:
        """Start a step: zero the statistics; ``detailed`` also measures the attention
        bound (two passes over q and k: the callback asks for it on logged steps, and on
        every step while a monitor that reads it every step is on, ``attn_logit`` by default);
        ``logged`` (default: ``detailed``) the lowest head entropy and, at the optimizer
        step, the per-block gradient norms and update ratios (``record_params``)."""
        self.detailed, self.logged = detailed, detailed if logged is None else logged
        self.units.step()
        dev = torch.device(device) if device is not None else next(self.model.parameters()).device
        have = self.buf.device if self.buf is not None else None
        # "cuda" (no index) names the current device: only a different type or index moves
        if have is None or have.type != dev.type or dev.index not in (None, have.index):
            self._allocate(dev)
        self.buf.copy_(self._fresh)
        self._q = [None] * len(self.attn)
        self._qs = [None] * len(self.attn)
        if (detailed or self.logged) and not self._attn_handles:
            for i, site in enumerate(self.view.attn):
                if site is None:
                    continue
                self._attn_handles.append(site.q_module.register_forward_hook(self._q_hook(i)))
                self._attn_handles.append(site.k_module.register_forward_hook(self._k_hook(i)))
            if self.view.log_z == "head":
                self._attn_handles.append(self.view.head.register_forward_hook(self._head_hook))
        elif not (detailed or self.logged) and self._attn_handles:
            self._remove(self._attn_handles)

    # ---- writers (training forwards only) ---------------------------------------------------
    def _block_hook(self, i):
        name = self.blocks[i]

        def hook(module, args, out):
            if module.training and self.buf is not None:
                # a Hugging Face block returns a tuple (hidden states first) in transformers 4
                h = out[0] if isinstance(out, tuple) else out
                absmax_into(h, self.buf, self._o_block + i)
                if self.units.finding:
                    self.units.block_out(name, h)

        return hook

    def _norm_hook(self, j):
        site = self.view.norms[j]
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(site.reduction or "")

        def hook(module, args):  # a norm that is not ours: its input, before it runs
            if not (module.training and self.buf is not None and args):
                return
            if self.units.last is not None:
                self.units.norm_in(j, args[0])
            if dt is None:  # it reduces in fp32 (find_norms): only a non-finite row breaks it
                absmax_into(args[0], self.buf, self._o_norm + j)
                return
            x = args[0]
            with torch.no_grad():  # its statistic as a 16-bit reduction makes it
                xd = x.detach().to(dt).float()
                if site.kind == "layernorm":
                    xd = xd - xd.mean(-1, keepdim=True)
                ss = xd.square().to(dt).float().sum(-1, keepdim=True)  # squares rounded, summed
                over = torch.isinf(ss.to(dt))
                ms = torch.where(over, torch.inf, ss / x.shape[-1]).to(dt)
            self.record_norm(j, x, ms, "rmsnorm")  # ms: a mean square, inf where it overflowed

        return hook

    def _head_hook(self, module, args, out):
        """A foreign model's logits [..., V]: every token's log Z (one logsumexp)."""
        if module.training and self.buf is not None and not recomputing():
            with torch.no_grad():
                self.record_log_z(torch.logsumexp(out.detach().float(), dim=-1).reshape(-1))

    def _q_hook(self, i):
        heads, entropy = self.view.attn[i].heads, self.view.attn[i].entropy

        def hook(module, args, out):  # out: [B, H, T, hd] (``heads`` makes it so)
            # measured once, not again in backward; not in an extra pass with the probe off
            # (the curvature's, buf None: its k hook would discard the bound)
            if module.training and self.buf is not None and not recomputing():
                if heads is not None:
                    out = heads(out, True)
                with torch.no_grad():
                    if self.detailed:
                        self._q[i] = head_norm_max(out)
                    if self.logged and entropy:
                        self._qs[i] = sampled_queries(out)

        return hook

    def _k_hook(self, i):
        heads, scale = self.view.attn[i].heads, self.view.attn[i].scale

        def hook(module, args, out):
            if not module.training or self.buf is None or recomputing():
                return
            if heads is not None:
                out = heads(out, False)
            with torch.no_grad():
                if self._q[i] is not None:
                    qn, kn = self._q[i], head_norm_max(out)  # [H], [H_kv]
                    if qn.numel() % kn.numel() == 0:  # grouped queries share a key head
                        v = (qn * kn.repeat_interleave(qn.numel() // kn.numel())).amax()
                    else:  # heads pooled (shape ambiguous): every q against every k
                        v = qn.amax() * kn.amax()
                    v = v * (scale if scale is not None else 1.0 / math.sqrt(out.shape[-1]))
                    k = self._o_attn + i
                    self.buf[k] = torch.maximum(self.buf[k], v)
                if self._qs[i] is not None:
                    k = self._o_ent + i
                    self.buf[k] = torch.maximum(
                        self.buf[k], -lowest_head_entropy(*self._qs[i], out)
                    )

        return hook

    def record_log_z(self, lz: torch.Tensor) -> None:
        """Every token's log Z of a training micro-batch ([N], from the loss: lm_loss's
        ``sink``): its max and sum, and the token count, into the step's slots."""
        if self.measure_log_z and self.buf is not None:
            b, k = self.buf, self._o_lzsum
            b[self._o_lz] = torch.maximum(b[self._o_lz], lz.amax())
            b[k] += lz.sum()
            b[k + 1] += lz.numel()

    def record_params(
        self, optimizer, grad_norm: torch.Tensor, max_norm: float, curvature=None
    ) -> None:
        """On a logged step's optimizer step (gradients final and unscaled, nothing applied):
        each block's gradient norm, the update/weight ratio the optimizer is about to apply
        and its mean g^2 / v_hat, and the whole model's (param_stats.py), into their slots;
        no host sync. ``curvature``: called with the parameters, their updates and
        preconditioners, it returns the two curvature quotients (stability/curvature.py),
        or None where it measured none."""
        if not self.logged or self.buf is None:
            return
        if self._param_idx is None or self._param_idx.device != self.buf.device:
            self._param_idx = torch.tensor(self._param_index, device=self.buf.device)
        got = block_grad_update_norms(self.param_groups, self._param_idx, optimizer, grad_norm,
                                      max_norm, keep=curvature is not None)  # fmt: skip
        if got is None:  # sharded gradients: not measured here
            return
        grad, ratio, g2v, whole, kept = got
        ng, b = len(self.param_groups), self.buf
        b[self._o_gn : self._o_gn + ng] = grad
        b[self._o_upd : self._o_upd + ng] = ratio
        b[self._o_g2v : self._o_g2v + ng] = g2v
        b[self._o_opt : self._o_opt + 2] = whole
        if kept is not None and all(k is not None for k in kept):
            params = [p for ps in self.param_groups.values() for p in ps]
            buf, self.buf = self.buf, None  # the extra pass is not the step's: no statistics
            try:
                q = curvature(params, [k[0] for k in kept], [k[1] for k in kept])
            finally:
                self.buf = buf
            if q is not None:
                b[self._o_opt + 2 : self._o_opt + 4] = torch.tensor(q, device=b.device)

    def record_norm(self, j: int, x: torch.Tensor, ms: torch.Tensor | None, kind: str) -> None:
        """Called by norm j's training forward with its input and, for the explicit backend,
        its per-row statistic ``ms`` (mean square + eps, or sum + eps for ScaleNorm, in the
        reduction dtype: inf exactly where the reduction overflowed).

        Three row counts, read in the reduction dtype (``ms.dtype``), where the norm computes
        (backends.py casts x to it first), not in the dtype x arrives in:

        - *overflowed*: the statistic is inf;
        - *NaN-producing*: the input is not finite once cast to the reduction dtype (NaN, inf,
          or an fp32 |x| >= 65520, which the fp16 cast rounds to inf): x * rsqrt(inf) has an
          inf * 0 = NaN (LayerNorm's mean subtraction makes the whole row NaN). Such a row
          also overflows when its statistic is inf;
        - *collapsed* (dead): overflowed although the input was finite in the reduction dtype:
          x * rsqrt(inf) = 0 exactly, a dead token; its gradient is 0 too, unless an fp16
          element reaches 32752 (the square's backward forms 2x = inf: inf * 0 = NaN).

        The other backends reduce in fp32: only a non-finite input breaks them (that row
        turns NaN, which the NaN monitor reports), so only their |x| max is measured.
        """
        buf = self.buf
        if buf is None:
            return
        if self.units.last is not None:
            self.units.norm_in(j, x)
        if ms is None:
            absmax_into(x, buf, self._o_norm + j)
            return
        with torch.no_grad():
            lo, hi = torch.aminmax(x, dim=-1)  # one read of x
            rowmax = torch.maximum(hi, -lo)  # [...]; NaN propagates
            bad = torch.isinf(ms.squeeze(-1))
            # |x| max is monotone under the cast: a row is finite in the reduction dtype iff
            # its largest |x_i| is (NaN stays NaN)
            finite = torch.isfinite(rowmax.to(ms.dtype))
            # the type says how its statistic reads as a mean square (ScaleNorm's is a sum)
            mean_sq = get_norm_type(kind).mean_square(ms.float().amax(), x.shape[-1])
            for k, v in (
                (self._o_norm + j, rowmax.amax().float()),
                (self._o_rms + j, mean_sq.sqrt()),
            ):
                buf[k] = torch.maximum(buf[k], v)
            buf[self._o_over + j] += bad.sum()
            buf[self._o_dead + j] += (bad & finite).sum()
            buf[self._o_nan + j] += (~finite).sum()

    # ---- the step's vector ------------------------------------------------------------------
    def vector(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(maxima, counts), views of the buffer: maxima are reduced across ranks with max,
        counts with sum.

        maxima = [block |x| max..., attn bound..., norm |x| max..., norm RMS max...]
        counts = [norm overflow rows..., norm collapsed rows..., norm NaN rows...]
        A pre-norm block's own slot stays -inf: ``unpack`` reads it from the next norm's.
        """
        if self.buf is None:
            self.reset(detailed=False, device=device)
        end = self.lead + self.n_maxima
        return self.buf[self.lead : end], self.buf[end:]

    def unpack(self, maxima: list[float], counts: list[float]) -> dict[str, dict[str, float]]:
        """Host lists -> named dicts for StepStats (readout.py: a value not measured this
        step is left out, never reported as 0)."""
        return unpack(self, maxima, counts)

    @staticmethod
    def _remove(handles: list) -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def remove(self) -> None:
        """Detach from the model: hooks removed, the norms stop reporting."""
        self.units.remove()
        self._remove(self._handles)
        self._remove(self._attn_handles)
        self.view.detach_sink(self)
        for m in self._norm_modules:
            if m.stats_sink is self:
                m.stats_sink, m.stats_index = None, -1
