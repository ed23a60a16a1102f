"""One call of the saturating-band backend (:mod:`.saturating_band`, whose docstring gives the
algorithm) planned over blocks of queries: each block's band of keys (its scores, the form's values,
widened until the form says the keys before it are not needed), the saturating transform's forward
and backward over bands plus the fused kernel for the far keys, and the band's gradients, by the
form's own backward (:meth:`~hf_posenc.encodings.saturating_transform.BandForm.band_with_gradients`)
or by autograd over leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..encodings.saturating_transform import BandForm, FormT, SaturatingTransform
from .softmax_parts import cpu_flash_backward, cpu_flash_forward, stack_groups, unstack_groups

#: adds a recomputed band's gradients (:meth:`BandPlan.recomputed_band`): (d values (B, Hq, R, K),
#: d tail (B, Hq, R) or None, grad_q, grad_k, grad_form), the last three added to in place
BandGradientsAdder = Callable[
    [torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor, "dict[str, torch.Tensor]"], None
]


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

    def recomputed_band(
        self,
        form: BandForm,
        q: torch.Tensor,
        k: torch.Tensor,
        start: int,
        stop: int,
        first: int,
        need_form: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, BandGradientsAdder]:
        """The block's band recomputed for backward: (its values (B, Hq, R, K), a saturating
        transform's tail over the block's queries (B, Hq, R) where the block has far keys, else
        None, and a function adding the band's gradients given those of its values and tail), by
        the form's own backward where it writes one
        (:meth:`~hf_posenc.encodings.saturating_transform.BandForm.band_with_gradients`), else by
        autograd over leaves (:meth:`leaf_band`; the form's tensors only with ``need_form``)."""
        with_tail = first > 0  # far keys: a saturating transform's tail stands for them
        q_rows, band_keys = q[:, :, start:stop], k[:, :, first:stop]
        if form.backward_by_hand:
            values, band_backward = form.band_with_gradients(
                q_rows, *self.band_scores(q_rows, band_keys, start, first)
            )
            tail = form.tail(q_rows) if with_tail and isinstance(form, SaturatingTransform) else None

            def add_by_hand(d_values, d_tail, grad_q, grad_k, grad_form) -> None:
                found = band_backward(d_values, d_tail)
                self.add_hand_grads(
                    found, q_rows, band_keys, grad_q, grad_k, grad_form, slice(start, stop), first
                )

            return values, tail, add_by_hand
        values, leaf_form, leaves, names = self.leaf_band(form, q, k, start, stop, first, need_form)
        with torch.enable_grad():
            tail = (
                leaf_form.tail(leaves[0])
                if with_tail and isinstance(leaf_form, SaturatingTransform)
                else None
            )

        def add_by_autograd(d_values, d_tail, grad_q, grad_k, grad_form) -> None:
            outputs, grads = [values], [d_values]
            if tail is not None and d_tail is not None:
                outputs.append(tail)
                grads.append(d_tail)
            found = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
            self.add_leaf_grads(found, leaves, names, grad_q, grad_k, grad_form, start, stop, first)

        return values, tail, add_by_autograd

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
            logits, tail, add_band_grads = self.recomputed_band(form, q, k, start, stop, first, need_form)
            with torch.no_grad():
                probs = torch.exp(logits.detach() - block_lse[..., None])  # (B, Hq, R, K)
                values = v[:, :, first:stop]
                stacked = stack_groups(probs, g)  # (B, Hkv, G*R, K)
                grad_v[:, :, first:stop] += torch.matmul(stacked.transpose(-1, -2), stack_groups(d_out, g))
                d_probs = unstack_groups(torch.matmul(stack_groups(d_out, g), values.transpose(-1, -2)), g)
                d_logits = probs * (d_probs - delta[:, :, rows, None])  # (B, Hq, R, K)
            # every row of dL sums to zero: the tail's gradient is minus the band's
            d_tail = None if tail is None else -d_logits.sum(-1)
            add_band_grads(d_logits, d_tail, grad_q, grad_k, grad_form)
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
