"""The saturating-band backend: causal attention whose explicit score stage needs only a band of
keys near each block of queries (a :class:`~hf_posenc.encodings.saturating_transform.BandForm`):

- a ``transform_scores`` stage that is, past a point of each row, the logit plus a per-query
  constant (:class:`~hf_posenc.encodings.saturating_transform.SaturatingTransform`, CoPE's): an
  explicit band plus one fused kernel call for the keys before it, merged by log-sum-exp (below);
- a ``normalize`` stage whose weights before the band are exactly 0
  (:class:`~hf_posenc.encodings.saturating_transform.VanishingWeights`, stick-breaking's past
  fp32's underflow): the band alone, ``out = W_band V_band``; backward recomputes the band
  (``dW = dO V^T``, ``dV = W^T dO``) and carries dW through the form's backward by hand
  (:meth:`~hf_posenc.encodings.saturating_transform.BandForm.band_with_gradients`: stick-breaking's)
  or under autograd.

For one block of queries ``[s, e)`` (:data:`BLOCK` rows) and the band of keys ``[f, e)``:

- band: ``S = scale * Q K_band^T``, the form's transformed logits ``L = band(S)`` with the causal
  mask, its softmax statistics ``lse_band``, ``out_band`` (explicit; (rows x band) values exist
  only while the block is computed). The band starts :data:`BAND_KEYS` keys before ``s`` (or the width the block before needed) and doubles until the form says every row is
  saturated at the band's first key (or it reaches key 0);
- far keys ``[0, f)``: all saturated, so their logits are ``S_ij + tail_i``: one call of torch's
  fused CPU flash-attention kernel (no mask: every far key is before every query of the block)
  gives ``out_far``, ``lse_far``, and the part's log-sum-exp is ``lse_far + tail_i``;

merged as ``lse = log(exp(lse_band) + exp(lse_far + tail))``, ``out = sum_p exp(lse_p - lse) out_p``
(see :mod:`.softmax_parts`). The result equals the eager path's softmax(transform(S)) V: the
form guarantees the far keys' transformed logits are exactly ``S + tail`` (CoPE: positions
clamped at ``npos_max - 1``).

Backward (FlashAttention-2's, Dao 2023, Algorithm 2, from the merged ``out`` and ``lse``): the far
keys through the fused kernel's backward with ``lse - tail`` (their weights include the
constant); the band recomputed, ``P = exp(L - lse)``, ``dL = P * (dO V^T - rowsum(dO * out))``,
and dL carried through the form to q, k and its tensors by the form's own backward where it
writes one (``BandForm.band_with_gradients``: CoPE's gates and position interpolation, no
autograd graph per block), else by autograd over leaves of q, the band's keys and the form's
tensors. The
tail's gradient needs no far-key sums: every row of dL sums to zero, so
``d tail_i = - sum over the band of dL_i``.

Kept for backward: q, k, v, the merged output and log-sum-exp (O(T), what a fused attention
keeps), the form's tensors and each block's band start. Cost: the band is O(T * band) and the
far part is the fused kernel's, instead of O(T^2) explicit scores, gates and their cumulative
sums (CoPE's band is about 2 (npos_max - 1) keys when its gates are near 1/2).

Registered as backend ``saturating_band`` (under ``auto`` and ``chunked``) for calls of an
encoding that gives a form (``Encoding.band_form``) for its one explicit stage (no ``logits``,
no bias), causal with no padding mask and no cache
(Tq = Tk) longer than one block and the first band width, fp32/fp64 on CPU (the fused kernel's dtypes), no dropout, no weights asked for, not
under torch.compile. Other calls (decoding, padding, windows, bf16, GPU) take the explicit paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..encodings.base import has_band_form
from ..encodings.saturating_transform import BandForm, FormT, SaturatingTransform, VanishingWeights
from .backend import AUTO, AttentionCall, Backend, register_backend
from .softmax_parts import (
    CPU_FLASH_BACKWARD,
    cpu_flash_backward,
    cpu_flash_forward,
    stack_groups,
    unstack_groups,
)

#: queries per block
BLOCK = 64
#: keys before a block's first query that the first block's band starts with (doubled until
#: saturated; the next blocks start from the width the one before needed)
BAND_KEYS = 128
DTYPES = (torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class BandPlan:
    scale: float
    groups: int
    block: int
    band_keys: int

    def spans(self, length: int) -> list[tuple[int, int]]:
        return [(start, min(length, start + self.block)) for start in range(0, length, self.block)]

    def band_of(
        self, form: BandForm, q_rows: torch.Tensor, keys: torch.Tensor, start: int, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``form.band`` of queries ``q_rows`` (B, Hq, R, D) from ``start`` over ``keys`` (B, Hkv,
        K, D) from key ``first``: (its (B, Hq, R, K) values, its (B, Hq, R) flag that nothing
        before the band is needed)."""
        scores, allowed, own = self.band_scores(q_rows, keys, start, first)
        return form.band(q_rows, scores, allowed, own)

    def band_scores(
        self, q_rows: torch.Tensor, keys: torch.Tensor, start: int, first: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The band's scaled logits (B, Hq, R, K), its causal mask and each query's own key (R, K)."""
        rows = torch.arange(start, start + q_rows.shape[-2], device=q_rows.device)
        key_index = torch.arange(first, first + keys.shape[-2], device=q_rows.device)
        allowed = key_index[None, :] <= rows[:, None]  # (R, K)
        own = key_index[None, :] == rows[:, None]  # (R, K) the query's own key
        stacked = stack_groups(q_rows, self.groups)  # (B, Hkv, G*R, D)
        scores = torch.matmul(stacked, keys.transpose(-1, -2)) * self.scale  # (B, Hkv, G*R, K)
        return unstack_groups(scores, self.groups), allowed, own

    def band(
        self, form: BandForm, q: torch.Tensor, k: torch.Tensor, start: int, stop: int, width: int
    ) -> tuple[int, torch.Tensor]:
        """The block's band, starting ``width`` keys before ``start`` and doubling until the form
        says no row needs a key before it (or it reaches key 0): (its first key, the form's
        (B, Hq, R, K) values over it)."""
        while True:
            first = max(0, start - width)
            values, done = self.band_of(form, q[:, :, start:stop], k[:, :, first:stop], start, first)
            if first == 0 or bool(done.all()):
                return first, values
            width *= 2

    def leaf_band(
        self,
        form: FormT,
        q: torch.Tensor,
        k: torch.Tensor,
        start: int,
        stop: int,
        first: int,
        need_form: bool,
    ) -> tuple[torch.Tensor, FormT, list[torch.Tensor], list[str]]:
        """The block's band recomputed under autograd from leaves (backward): (its values, the form
        on leaves of its tensors (``need_form``) or the form itself, the leaves [q rows, band keys,
        form tensors...], the form tensors' names)."""
        with torch.enable_grad():
            q_leaf = q[:, :, start:stop].detach().requires_grad_()
            k_leaf = k.detach()[:, :, first:stop].requires_grad_()  # the band's keys only
            leaves = {n: t.detach().requires_grad_() for n, t in form.tensors().items()} if need_form else {}
            leaf_form = form.replace(**leaves) if leaves else form
            values, _ = self.band_of(leaf_form, q_leaf, k_leaf, start, first)
        return values, leaf_form, [q_leaf, k_leaf, *leaves.values()], list(leaves)

    def add_hand_grads(
        self,
        found: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]],
        q_rows: torch.Tensor,
        band_keys: torch.Tensor,
        grad_q: torch.Tensor,
        grad_k: torch.Tensor,
        grad_form: dict[str, torch.Tensor],
        rows: slice,
        first: int,
    ) -> None:
        """Adds a hand-written band backward's (dS, dq, the form's tensors' gradients) into the full
        gradients: dS through the scores S = scale q K_band^T to q and the band's keys."""
        d_scores, d_q, d_tensors = found
        g = self.groups
        stacked = stack_groups(d_scores.to(q_rows.dtype), g)  # (B, Hkv, G*R, K)
        through_scores = unstack_groups(torch.matmul(stacked, band_keys), g) * self.scale
        d_q = through_scores if d_q is None else d_q + through_scores
        grad_q[:, :, rows] += d_q
        grad_k[:, :, first : first + band_keys.shape[-2]] += torch.matmul(
            stacked.transpose(-1, -2), stack_groups(q_rows, g)
        ).mul_(self.scale)
        for name, grad in d_tensors.items():
            if name in grad_form:
                grad_form[name] += grad

    @staticmethod
    def add_leaf_grads(
        found: tuple[torch.Tensor | None, ...],
        leaves: list[torch.Tensor],
        names: list[str],
        grad_q: torch.Tensor,
        grad_k: torch.Tensor,
        grad_form: dict[str, torch.Tensor],
        start: int,
        stop: int,
        first: int,
    ) -> None:
        """Adds autograd's gradients of :meth:`leaf_band`'s leaves into the full gradients."""
        grad_q[:, :, start:stop] += _or_zero(found[0], leaves[0])
        grad_k[:, :, first:stop] += _or_zero(found[1], leaves[1])
        for name, grad in zip(names, found[2:], strict=True):
            if grad is not None:
                grad_form[name] += grad

    def forward(
        self, form: SaturatingTransform, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """q (B,Hq,T,D), k/v (B,Hkv,T,D) -> (out (B,Hq,T,D) laid out as (B,T,Hq,D), lse (B,Hq,T),
        each block's band start)."""
        length, g = q.shape[-2], self.groups
        out = q.new_empty(q.shape[0], length, q.shape[1], q.shape[-1]).transpose(1, 2)  # (B, Hq, T, D)
        lse = q.new_empty(q.shape[:-1])
        firsts = []
        width = self.band_keys  # each block starts from the width the one before needed
        for start, stop in self.spans(length):
            first, logits = self.band(form, q, k, start, stop, width)  # (B, Hq, R, K)
            width = max(width, start - first)
            firsts.append(first)
            q_rows = q[:, :, start:stop]
            band_lse = torch.logsumexp(logits, dim=-1)  # (B, Hq, R): the diagonal is always allowed
            probs = torch.exp(logits - band_lse[..., None])
            band_out = unstack_groups(
                torch.matmul(stack_groups(probs, g), v[:, :, first:stop]), g
            )  # (B, Hq, R, D)
            if first == 0:
                out[:, :, start:stop] = band_out
                lse[:, :, start:stop] = band_lse
                continue
            far_out, far_lse = cpu_flash_forward(
                stack_groups(q_rows, g), k[:, :, :first], v[:, :, :first], None, self.scale
            )  # (B, Hkv, G*R, D), (B, Hkv, G*R)
            far_lse = unstack_groups(far_lse, g) + form.tail(q_rows)  # (B, Hq, R)
            merged = torch.logaddexp(band_lse, far_lse)
            out[:, :, start:stop] = torch.exp(band_lse - merged)[..., None] * band_out + torch.exp(
                far_lse - merged
            )[..., None] * unstack_groups(far_out, g)
            lse[:, :, start:stop] = merged
        return out, lse, firsts

    def backward(
        self,
        form: SaturatingTransform,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        firsts: list[int],
        need_form: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Gradients of q, k, v and of the form's tensors (by name; empty without ``need_form``)."""
        length, g = q.shape[-2], self.groups
        grad_out = grad_out.to(q.dtype)
        grad_q, grad_k, grad_v = (x.new_zeros(x.shape) for x in (q, k, v))
        tensors = form.tensors()
        grad_form = {name: torch.zeros_like(t) for name, t in tensors.items()} if need_form else {}
        delta = (grad_out * out).sum(-1)  # (B, Hq, T)
        for (start, stop), first in zip(self.spans(length), firsts, strict=True):
            rows = slice(start, stop)
            d_out, block_lse = grad_out[:, :, rows], lse[:, :, rows]
            q_rows, band_keys = q[:, :, rows], k[:, :, first:stop]
            # the band's backward by hand where the form writes it, else through autograd
            by_hand = None
            if form.backward_by_hand:
                by_hand = form.band_with_gradients(q_rows, *self.band_scores(q_rows, band_keys, start, first))
            if by_hand is not None:
                logits, band_backward = by_hand
                tail = form.tail(q_rows) if first > 0 else None
            else:
                logits, leaf_form, leaves, names = self.leaf_band(form, q, k, start, stop, first, need_form)
                with torch.enable_grad():
                    tail = leaf_form.tail(leaves[0]) if first > 0 else None
            with torch.no_grad():
                probs = torch.exp(logits.detach() - block_lse[..., None])  # (B, Hq, R, K)
                values = v[:, :, first:stop]
                stacked = stack_groups(probs, g)  # (B, Hkv, G*R, K)
                grad_v[:, :, first:stop] += torch.matmul(stacked.transpose(-1, -2), stack_groups(d_out, g))
                d_probs = unstack_groups(torch.matmul(stack_groups(d_out, g), values.transpose(-1, -2)), g)
                d_logits = probs * (d_probs - delta[:, :, rows, None])  # (B, Hq, R, K)
            # every row of dL sums to zero: the tail's gradient is minus the band's
            d_tail = None if tail is None else -d_logits.sum(-1)
            if by_hand is not None:
                self.add_hand_grads(
                    band_backward(d_logits, d_tail), q_rows, band_keys, grad_q, grad_k, grad_form, rows, first
                )
            else:
                outputs, grads = [logits], [d_logits]
                if tail is not None and d_tail is not None:
                    outputs.append(tail)
                    grads.append(d_tail)
                found = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
                self.add_leaf_grads(found, leaves, names, grad_q, grad_k, grad_form, start, stop, first)
            if tail is None:  # no far keys
                continue
            dq, dk, dv = cpu_flash_backward(
                stack_groups(d_out, g),
                stack_groups(q[:, :, rows], g),
                k[:, :, :first],
                v[:, :, :first],
                stack_groups(out[:, :, rows], g),
                stack_groups((block_lse - tail.detach())[..., None], g)[..., 0],
                None,
                self.scale,
            )
            grad_q[:, :, rows] += unstack_groups(dq, g)
            grad_k[:, :, :first] += dk
            grad_v[:, :, :first] += dv
        return grad_q, grad_k, grad_v, grad_form


def _or_zero(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


class _SaturatingBandAttention(torch.autograd.Function):
    """The merged attention with the O(T) saved state of a fused kernel (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, plan: BandPlan, form: SaturatingTransform, names: tuple[str, ...], q, k, v, *tensors
    ):
        form = form.replace(**dict(zip(names, tensors, strict=True)))
        out, lse, firsts = plan.forward(form, q, k, v)
        ctx.plan, ctx.form, ctx.names, ctx.firsts = plan, form, names, firsts
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        form = ctx.form.replace(**dict(zip(ctx.names, tensors, strict=True)))
        need_form = any(ctx.needs_input_grad[6:])
        grad_q, grad_k, grad_v, grad_form = ctx.plan.backward(
            form, grad_out, q, k, v, out, lse, ctx.firsts, need_form
        )
        return (None, None, None, grad_q, grad_k, grad_v, *(grad_form.get(name) for name in ctx.names))


def _vanishing_forward(plan: BandPlan, form: BandForm, q, k, v) -> tuple[torch.Tensor, list[int]]:
    """Weights that vanish before each block's band: out = W_band V_band, laid out (B, T, Hq, D)."""
    length, g = q.shape[-2], plan.groups
    out = q.new_empty(q.shape[0], length, q.shape[1], v.shape[-1]).transpose(1, 2)  # (B, Hq, T, D)
    firsts, width = [], plan.band_keys
    for start, stop in plan.spans(length):
        first, weights = plan.band(form, q, k, start, stop, width)  # (B, Hq, R, K)
        width = max(width, start - first)
        firsts.append(first)
        band = torch.matmul(stack_groups(weights.to(v.dtype), g), v[:, :, first:stop])
        out[:, :, start:stop] = unstack_groups(band, g)
    return out, firsts


class _VanishingBandAttention(torch.autograd.Function):
    """Vanishing weights over each block's band; backward recomputes the band under autograd
    (dW = dO V^T, dV = W^T dO), keeping q, k, v and the form's tensors (O(T))."""

    @staticmethod
    def forward(ctx: Any, plan: BandPlan, form: BandForm, names: tuple[str, ...], q, k, v, *tensors):
        form = form.replace(**dict(zip(names, tensors, strict=True)))
        out, firsts = _vanishing_forward(plan, form, q, k, v)
        ctx.plan, ctx.form, ctx.names, ctx.firsts = plan, form, names, firsts
        ctx.save_for_backward(q, k, v, *tensors)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *tensors = ctx.saved_tensors
        plan, g = ctx.plan, ctx.plan.groups
        form = ctx.form.replace(**dict(zip(ctx.names, tensors, strict=True)))
        need_form = any(ctx.needs_input_grad[6:])
        grad_out = grad_out.to(v.dtype)
        grad_q, grad_k, grad_v = (x.new_zeros(x.shape) for x in (q, k, v))
        grad_form = {name: torch.zeros_like(t) for name, t in form.tensors().items()} if need_form else {}
        for (start, stop), first in zip(plan.spans(q.shape[-2]), ctx.firsts, strict=True):
            d_out = stack_groups(grad_out[:, :, start:stop], g)  # (B, Hkv, G*R, D)
            q_rows, band_keys = q[:, :, start:stop], k[:, :, first:stop]
            if form.backward_by_hand:  # the band's backward by hand, else through autograd
                weights, band_backward = form.band_with_gradients(
                    q_rows, *plan.band_scores(q_rows, band_keys, start, first)
                )
            else:
                weights, _, leaves, names = plan.leaf_band(form, q, k, start, stop, first, need_form)
            with torch.no_grad():
                stacked = stack_groups(weights.detach().to(v.dtype), g)  # (B, Hkv, G*R, K)
                grad_v[:, :, first:stop] += torch.matmul(stacked.transpose(-1, -2), d_out)
                d_weights = unstack_groups(torch.matmul(d_out, v[:, :, first:stop].transpose(-1, -2)), g)
            if form.backward_by_hand:
                found_by_hand = band_backward(d_weights.to(weights.dtype), None)
                plan.add_hand_grads(
                    found_by_hand, q_rows, band_keys, grad_q, grad_k, grad_form, slice(start, stop), first
                )
                continue
            found = torch.autograd.grad(weights, leaves, d_weights.to(weights.dtype), allow_unused=True)
            plan.add_leaf_grads(found, leaves, names, grad_q, grad_k, grad_form, start, stop, first)
        return (None, None, None, grad_q, grad_k, grad_v, *(grad_form.get(name) for name in ctx.names))


def attend_saturating_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    form: BandForm,
    softmax_scale: float,
    block: int | None = None,
    band_keys: int | None = None,
) -> torch.Tensor:
    """q (B,Hq,T,D), k/v (B,Hkv,T,D), causal (no mask, no cache), fp32/fp64 on CPU -> (B,T,Hq,D).

    ``block``: queries per block (default :data:`BLOCK`); ``band_keys``: the band's first width
    before a block (default :data:`BAND_KEYS`)."""
    plan = BandPlan(softmax_scale, q.shape[1] // k.shape[1], block or BLOCK, band_keys or BAND_KEYS)
    tensors = form.tensors()
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors.values()))
    if isinstance(form, VanishingWeights):
        if training:
            out = _VanishingBandAttention.apply(plan, form, tuple(tensors), q, k, v, *tensors.values())
        else:
            out, _ = _vanishing_forward(plan, form, q, k, v)
    elif isinstance(form, SaturatingTransform):
        if training:
            out = _SaturatingBandAttention.apply(plan, form, tuple(tensors), q, k, v, *tensors.values())
        else:
            out, _, _ = plan.forward(form, q, k, v)
    else:
        raise TypeError(f"form {type(form).__name__}: a SaturatingTransform or VanishingWeights")
    return out.transpose(1, 2)  # (B, T, Hq, D)


@register_backend
class SaturatingBandBackend(Backend):
    name = "saturating_band"
    priority = 44
    requests = frozenset({AUTO, "chunked"})

    def serves(self, call: AttentionCall) -> bool:
        q, k, v = call.q, call.k, call.v
        return (
            len(call.stages & {"logits", "transform_scores", "normalize", "score_bias"}) == 1
            and bool(call.stages & {"transform_scores", "normalize"})
            and has_band_form(call.encoding)
            and call.bias is None
            and call.mask is None
            and call.dropout_p == 0.0
            and not call.want_weights
            and q.device.type == "cpu"
            and q.dtype in DTYPES
            and k.dtype == v.dtype == q.dtype
            and q.shape[-1] == v.shape[-1]  # the fused kernel's widths
            # decoding, and lengths within the first band (no far keys): the explicit paths
            and q.shape[-2] == k.shape[-2] > BLOCK + BAND_KEYS
            and CPU_FLASH_BACKWARD is not None
            and not torch.compiler.is_compiling()
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        form = call.encoding.band_form(call.score)
        out = attend_saturating_band(call.q, call.k, call.v, form=form, softmax_scale=call.softmax_scale)
        return out.to(call.v.dtype), None
