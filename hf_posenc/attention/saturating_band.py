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

from typing import Any

import torch

from ..encodings.base import has_band_form
from ..encodings.saturating_transform import BandForm, SaturatingTransform, VanishingWeights
from .backend import AUTO, AttentionCall, Backend, register_backend
from .band_plan import BandPlan
from .softmax_parts import CPU_FLASH_BACKWARD, stack_groups, unstack_groups

#: queries per block
BLOCK = 64
#: keys before a block's first query that the first block's band starts with (doubled until
#: saturated; the next blocks start from the width the one before needed)
BAND_KEYS = 128
DTYPES = (torch.float32, torch.float64)


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
    """Vanishing weights over each block's band; backward recomputes the band (dW = dO V^T, dV =
    W^T dO; dW through the form's backward, :meth:`.band_plan.BandPlan.recomputed_band`), keeping
    q, k, v and the form's tensors (O(T))."""

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
            weights, _, add_band_grads = plan.recomputed_band(form, q, k, start, stop, first, need_form)
            with torch.no_grad():
                stacked = stack_groups(weights.detach().to(v.dtype), g)  # (B, Hkv, G*R, K)
                grad_v[:, :, first:stop] += torch.matmul(stacked.transpose(-1, -2), d_out)
                d_weights = unstack_groups(torch.matmul(d_out, v[:, :, first:stop].transpose(-1, -2)), g)
            add_band_grads(d_weights.to(weights.dtype), None, grad_q, grad_k, grad_form)
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
