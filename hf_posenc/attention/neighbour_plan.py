"""One neighbour-backend call's plan: its query blocks, each block's parts (the near band, the far
keys before it attended without a mask, the rest of the far keys with one), and the merged
forward and FlashAttention-2-style backward over them (see :mod:`.neighbour` for the method).
Split from :mod:`.neighbour`, which holds the autograd function, the entry points and the
backend registration.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.layout import causal_keys
from ..encodings.call import NeighbourSplit
from . import softmax_parts
from .host_heap import trim_host_heap
from .softmax_parts import additive_mask, finite, stack_groups, unstack_groups

#: a training step's neighbour-backend calls (forwards and backwards, CPU, several blocks) per heap
#: trim. glibc held 170-290 MiB free in a 530-630 MiB heap at each call of a SelfExtend training
#: step (the bench's model, T=2048), so a trim per call handed back and refaulted ~200 MiB per
#: layer: steps of 0.67-0.68 s with a trim per call, 0.63 every 2nd, 0.60 every 4th, 0.52 never;
#: peak resident set 869-874 / 879-891 / 895 / 1145 MiB (one process each, 5 steps, 2026-11-28,
#: idle); `scripts/cpu_constant_ab.py --encoding selfextend --mode train --length 2048 --constant
#: hf_posenc.attention.neighbour_plan:TRIM_EVERY --values 1 4 --native`: 1.45x -> 1.29x native
#: (rerope 1.44x -> 1.30x). Inference trims after every call: every 4th saved no time there and
#: held 20-40 MiB more at T=4096
TRIM_EVERY = 4
_TRIM_CALLS = [0]


@dataclasses.dataclass(frozen=True)
class NeighbourPlan:
    """One call's blocks and masks: what both forward and backward need besides the tensors."""

    split: NeighbourSplit  # its window, positions and is_near (:func:`_positions_only`: no tensors kept)
    mask: torch.Tensor | None  # (B|1, 1, Tq, Tk) bool, or None (causal)
    scale: float
    block: int
    groups: int  # query heads per key head
    fused: bool  # whether to use torch's fused CPU kernel where it runs

    def spans(self, q_len: int) -> list[tuple[int, int]]:
        return [(start, min(q_len, start + self.block)) for start in range(0, q_len, self.block)]

    def parts(
        self, q_len: int, k_len: int, start: int, stop: int
    ) -> list[tuple[bool, slice, torch.Tensor | None]]:
        """Block [start, stop)'s parts: (far?, key range, allowed (B|1, 1, rows, keys) bool, or None
        where every key of the range is allowed for every row)."""
        window, offset = self.split.window, k_len - q_len  # query a sits at key index offset + a
        k_end, rows = causal_keys(q_len, k_len, stop), slice(start, stop)
        band = slice(max(0, offset + start - window + 1), k_end)
        far_end = max(0, offset + stop - window)
        # The far keys before the band: with no mask they are causal for every row of the block; when
        # their positions are all at least ``window`` below every row's (positions counting tokens),
        # they are all far and attended without a mask (no (rows x keys) tensor at all).
        open_end = 0
        # (not under torch.compile: the check reads positions' values, a data-dependent branch)
        if self.mask is None and min(band.start, far_end) > 0 and not torch.compiler.is_compiling():
            open_end = min(band.start, far_end)
            gap = self.split.q_positions[:, rows].amin(dim=-1) - self.split.k_positions[:, :open_end].amax(
                dim=-1
            )
            open_end = open_end if bool((gap >= window).all()) else 0
        if self.mask is None:  # bottom-right causal, as causal_mask, without its int64 distances
            device = self.split.q_positions.device
            allowed = torch.ones(stop - start, k_end, dtype=torch.bool, device=device)
            allowed = allowed.tril(k_end - stop + start)[None, None]
        else:
            allowed = self.mask[..., rows, :k_end]
        parts: list[tuple[bool, slice, torch.Tensor | None]] = []
        parts.append((False, band, allowed[..., band] & self.split.is_near(rows, band)))
        if open_end > 0:
            parts.append((True, slice(0, open_end), None))
        if far_end > open_end:
            keys = slice(open_end, far_end)
            parts.append((True, keys, allowed[..., keys] & ~self.split.is_near(rows, keys)))
        return parts

    def trim_heap(self, out: torch.Tensor, training: bool) -> None:
        """After a call of several blocks on CPU: the blocks' temporaries left holes in the C heap
        that stay resident under the tensors allocated after them (see :mod:`.host_heap`); handed
        back after every call without gradients, after every :data:`TRIM_EVERY`-th of a training
        step's forwards and backwards."""
        if out.device.type == "cpu" and out.shape[-2] > self.block and not torch.compiler.is_compiling():
            _TRIM_CALLS[0] += 1
            if not training or _TRIM_CALLS[0] % TRIM_EVERY == 0:
                trim_host_heap()

    def bias(self, allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """(B|1, 1, rows, keys) bool -> (B|1, 1, G*rows, keys) additive mask for stacked query heads."""
        return (
            None if allowed is None else additive_mask(allowed[:, :, None], dtype, self.groups).flatten(2, 3)
        )

    def forward(
        self,
        near_q: torch.Tensor,
        far_q: torch.Tensor,
        near_k: torch.Tensor,
        far_k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q's (B,Hq,Tq,D), k's/v (B,Hkv,Tk,D) -> (out (B,Hq,Tq,D), lse (B,Hq,Tq), finite: 0 where no key)."""
        forward, _ = softmax_parts.kernels(near_q, v, self.fused)
        q_len, k_len = near_q.shape[-2], near_k.shape[-2]
        # (B, Hq, Tq, D) over (B, Tq, Hq, D) memory: the caller's (B, Tq, Hq, D) output, and the
        # output projection's input, are then this storage, not a copy of it
        b, heads, q_len_ = near_q.shape[:-1]
        out = near_q.new_empty(b, q_len_, heads, v.shape[-1]).transpose(1, 2)
        lse = near_q.new_empty(near_q.shape[:-1])
        for start, stop in self.spans(q_len):
            outs, lses = [], []
            for is_far, keys, allowed in self.parts(q_len, k_len, start, stop):
                q, k = (far_q, far_k) if is_far else (near_q, near_k)
                part_out, part_lse = forward(
                    stack_groups(q[:, :, start:stop], self.groups),
                    k[:, :, keys],
                    v[:, :, keys],
                    self.bias(allowed, q.dtype),
                    self.scale,
                )
                if allowed is not None:  # a row with no key of this part: lse -inf (the kernel gives 0)
                    any_key = allowed.any(dim=-1).repeat(1, 1, self.groups)  # (B|1, 1, G*rows)
                    part_lse = part_lse.masked_fill(~any_key, float("-inf"))
                outs.append(unstack_groups(part_out, self.groups))
                lses.append(unstack_groups(part_lse, self.groups))
            block_lse = finite(torch.stack(lses).logsumexp(dim=0))  # (B, Hq, rows); 0 where no key at all
            block_out = torch.zeros_like(outs[0])
            for part_out, part_lse in zip(outs, lses, strict=True):
                block_out += (
                    torch.exp(part_lse - block_lse)[..., None] * part_out
                )  # exp(-inf) = 0: empty part
            out[:, :, start:stop] = block_out
            lse[:, :, start:stop] = block_lse
        return out, lse

    def backward(
        self,
        grad_out: torch.Tensor,
        near_q: torch.Tensor,
        far_q: torch.Tensor,
        near_k: torch.Tensor,
        far_k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Gradients for (near_q, far_q, near_k, far_k, v), block by block, part by part."""
        _, backward = softmax_parts.kernels(near_q, v, self.fused)
        q_len, k_len, g = near_q.shape[-2], near_k.shape[-2], self.groups
        grads = {
            name: torch.zeros_like(t)
            for name, t in (("nq", near_q), ("fq", far_q), ("nk", near_k), ("fk", far_k), ("v", v))
        }
        grad_out = grad_out.to(out.dtype)
        for start, stop in self.spans(q_len):
            rows = slice(start, stop)
            d_out, b_out = stack_groups(grad_out[:, :, rows], g), stack_groups(out[:, :, rows], g)
            b_lse = stack_groups(lse[:, :, rows, None], g)[..., 0]
            for is_far, keys, allowed in self.parts(q_len, k_len, start, stop):
                q, k = (far_q, far_k) if is_far else (near_q, near_k)
                dq, dk, dv = backward(
                    d_out,
                    stack_groups(q[:, :, rows], g),
                    k[:, :, keys],
                    v[:, :, keys],
                    b_out,
                    b_lse,
                    self.bias(allowed, q.dtype),
                    self.scale,
                )
                grads["fq" if is_far else "nq"][:, :, rows] += unstack_groups(dq, g)
                grads["fk" if is_far else "nk"][:, :, keys] += dk
                grads["v"][:, :, keys] += dv
        self.trim_heap(out, training=True)
        return grads["nq"], grads["fq"], grads["nk"], grads["fk"], grads["v"]
