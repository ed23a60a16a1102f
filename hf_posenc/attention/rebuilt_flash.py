"""One causal query block whose bias is written out per block (FIRE past its threshold) and needs
its gradient, trained on torch's fused CPU flash-attention kernel with the block's log-sum-exp
kept, on CPU in fp32/fp64 without a padding mask (:class:`RebuiltBiasFlashAttention`).

Forward: the block's bias built without gradients (into the chunked backend's shared buffer,
a group of heads at a time where the form builds it so, each group attended before the next;
over the keys in reverse order where the form builds it cheaper that way, FIRE on CPU, with k
and v in that order: the chunked backend hands them so too, views of one reversed copy per
layer), the fused kernel ``_scaled_dot_product_flash_attention_for_cpu`` with it as the mask,
which also returns the rows' log-sum-exp. Kept for backward: q, k, v, the output, the
log-sum-exp (O(rows)) and the bias form's O(T) tensors, as
:class:`~.bias_block.RebuiltBiasAttention` keeps.

Backward: the bias built once more, with gradients, from the form's tensors (over the keys in
reverse order where the form rebuilds it so, FIRE's bands of distances: k and v in that order
from one copy per layer made in backward, dk and dv added into one sum per layer, both by
:class:`ReversedGradients`), and the FlashAttention-2 gradients
from the kept statistics (Dao 2023, Algorithm 2):

    P = exp(s Q K^T + bias - lse),  dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),
    dQ = s dS K,  dK = s dS^T Q,  dbias = dS (summed over a batch the bias is shared by)

computed a group of :data:`REBUILT_HEADS` heads at a time (:class:`_Chain`) in the rebuilt
block: bias - lse written there, then ``baddbmm_`` adds the group's scores (the exponent in base
2: log2(e) times it), weights below 2^-100 flushed to 0 and ``exp2_`` (torch's exp leaves its
fast path for inputs below about -87 and for the masked keys, see
:mod:`hf_posenc.core.underflow`), multiplied in place by dO V^T - rowsum(dO * O) (one batched
product of dO widened by a column of -rowsum(dO * O) and V widened by ones, into the group's
(g, R, K) work buffer): dS. Where the form rebuilds its block a group of heads at a time
(:class:`~hf_posenc.encodings.headwise_rebuild.HeadwiseRebuild`: FIRE's bands, fp32, one row of
normalisers), each group's block is written into one small buffer, its chain run and its dS
handed to the form, whose gradients it adds up by hand, before the next group is written; else
the whole (B, H, R, K) block is rebuilt with gradients and dbias sent through its own backward.
Neither the block nor its dS exists for every head at once: a training step's peak by the
profiler's count, FIRE at T=2048 in the bench's model (``python -m
hf_posenc.recipes.benchmark.peak_memory --encodings fire --hidden-size 256 --num-heads 8
--vocab-size 256 --lengths 1024 2048``; native 157 MiB): every head at once 197 MiB, one head
168, four heads (:data:`REBUILT_HEADS`) 179 (181 with the forward's band plans kept for the
rebuild). No softmax (the statistics are kept) and no second
forward; the block's (rows x keys) buffers exist only while it is computed.

Before, the block's backward recomputed its weights by a softmax of explicitly recomputed
scores (:func:`~.bias_block.block_gradients`) and built its bias twice (once without gradients
in forward, once with them in backward, which stays).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .bias_block import differentiable_copies, tensor_gradients
from .softmax_parts import CPU_FLASH
from .toeplitz_layout import FLUSH, LOG2E, work_buffer

if TYPE_CHECKING:
    from ..encodings.headwise_rebuild import HeadwiseRebuild

#: dtypes the block's forward and backward run in (the fused kernel computes in them)
FLASH_DTYPES = (torch.float32, torch.float64)
#: heads of a block whose backward chain runs at a time, in batched products, and that a
#: :class:`~hf_posenc.encodings.headwise_rebuild.HeadwiseRebuild` rebuilds at a time: the rebuilt
#: block, its dS and the chain's work buffers are one group's. Batched over heads, torch's two
#: threads each take whole heads; one head at a time they split each (R, K) product, and on the
#: 2-vCPU VM of 2026-11-28 such a split product (256 x 32 by 32 x 2048) ran at 0.18 ms in some
#: stretches of minutes and 0.35 ms in others (the same process; a batch of 4 heads unchanged,
#: 0.19 per head): FIRE's training step at T=2048 (scripts/cpu_constant_ab.py-style alternating
#: rounds, classified by that product's time): 1 head 1.44x native in the fast stretches and
#: 1.76x in the slow, 4 heads 1.47x and 1.57x; memory above (168 -> 179 MiB)
REBUILT_HEADS = 4


def serves(q: torch.Tensor, mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether :class:`RebuiltBiasFlashAttention` serves the blocks of this call: CPU, fp32/fp64,
    no padding mask (a query that may attend nothing would get the fused kernel's uniform
    weights in forward, which the kept statistics do not recompute), no dropout, this torch has
    the fused kernel, not under torch.compile."""
    return (
        CPU_FLASH is not None
        and q.device.type == "cpu"
        and q.dtype in FLASH_DTYPES
        and mask is None
        and dropout_p == 0.0
        and not torch.compiler.is_compiling()
    )


class RebuiltBiasFlashAttention(torch.autograd.Function):
    """q (B, H, R, D), k/v (B, H, K, D) of one causal block and, or None, the same k and v over
    the keys in reverse order (views of one reversed copy of the layer's, made by
    :class:`ReversedKeyValues`: forward attends them where the bias comes so, and backward adds
    their gradients into that copy's ``sink``, a :class:`ReversedGradients`, with no flip per
    block; the copies are not kept, k and v are), ``build(*tensors)`` -> its bias
    (B|1, H, R, K) in q's dtype (the future keys at the dtype's minimum), ``build_reversed()``
    -> the same over the keys in reverse order, without gradients, or an iterator of (heads,
    their block (B|1, g, R, K)) each read before the next is asked for, or None (then forward
    takes ``build``; either may be given as None / return None), ``rebuild_reversed(*tensors)``
    -> the reversed block with gradients for backward, or a
    :class:`~hf_posenc.encodings.headwise_rebuild.HeadwiseRebuild` of it, or None (then backward takes
    ``build``; may be None too), ``buffers`` (a dict
    where backward keeps its work buffer for the next block, or None), the form's tensors ->
    softmax(q k^T scale + bias) v, (B, H, R, D); gradients of q, k, v and the tensors. See the
    module's docstring."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        k_reversed,
        v_reversed,
        sink: ReversedGradients | None,
        scale: float,
        build,
        build_reversed,
        rebuild_reversed,
        buffers: dict | None,
        *tensors: torch.Tensor,
    ):
        assert CPU_FLASH is not None
        ctx.given_reversed = k_reversed is not None
        ctx.sink = sink
        with torch.no_grad():
            # over the keys in reverse order where the form builds that cheaper (attention does not
            # depend on the keys' order; k and v in that order, (B, H, K, D) each)
            backwards = None if build_reversed is None else build_reversed()
            if backwards is not None:
                if k_reversed is None:
                    k_reversed, v_reversed = k.flip(2), v.flip(2)
                if isinstance(backwards, torch.Tensor):
                    out, lse = CPU_FLASH(
                        q, k_reversed, v_reversed, 0.0, False, attn_mask=backwards, scale=scale
                    )
                else:  # (heads, their block) in turn, each used before the next is built
                    out = q.new_empty(q.shape)
                    lse = q.new_empty(q.shape[:-1])
                    for heads, block in backwards:
                        out[:, heads], lse[:, heads] = CPU_FLASH(
                            q[:, heads],
                            k_reversed[:, heads],
                            v_reversed[:, heads],
                            0.0,
                            False,
                            attn_mask=block,
                            scale=scale,
                        )
            else:
                out, lse = CPU_FLASH(q, k, v, 0.0, False, attn_mask=build(*tensors), scale=scale)
        ctx.scale, ctx.build, ctx.rebuild_reversed, ctx.buffers = scale, build, rebuild_reversed, buffers
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        scale = ctx.scale
        inputs = differentiable_copies(tensors, ctx.needs_input_grad[11:])
        with torch.enable_grad():
            # (B|1, H, R, K), with gradients to the form's tensors, or a HeadwiseRebuild: over the keys in
            # reverse order where the form rebuilds it so (then k and v flipped here, dk and dv to the
            # reversed copies)
            bias = None if ctx.rebuild_reversed is None else ctx.rebuild_reversed(*inputs)
            reverse = bias is not None
            if bias is None:
                bias = ctx.build(*inputs)
        if reverse:  # k and v over the keys in reverse order: views of the layer's copy where it has one
            if ctx.given_reversed and ctx.sink is not None:
                k, v = ctx.sink.reversed_keys(k.shape[2])
            else:
                k, v = k.flip(2), v.flip(2)
        chain = _Chain(q, k, v, out, lse, grad_out, scale, ctx.buffers)
        if isinstance(bias, torch.Tensor):
            # log2(e) (bias - lse + s q k^T): bias - lse first (a masked key's minimum stays finite),
            # in place when the bias has the batch's rows (its backward reads none of its values)
            scores = bias.detach()
            if scores.shape[0] == chain.batch and scores.is_contiguous():
                scores.sub_(lse[..., None])
            else:
                scores = torch.sub(scores, lse[..., None])  # (B, H, R, K)
            chain.run(scores, slice(0, chain.heads))
            tensor_grads = tensor_gradients(bias, inputs, scores)  # scores: (B, H, R, K) dS
        else:
            tensor_grads = _headwise(bias, chain, lse, inputs)
        grad_q, grad_k, grad_v = chain.gradients()  # dk, dv (B, H, K, D) transposed views
        keys_grads: tuple[torch.Tensor | None, ...] = (None, None, None, None)
        if not reverse:
            keys_grads = (grad_k.contiguous(), grad_v.contiguous(), None, None)
        elif ctx.given_reversed:  # added into the layer's reversed k and v where this block's keys are
            if ctx.sink is not None:  # (None: the copies need no gradient)
                ctx.sink.add(grad_k, grad_v)
        else:  # (flipped in forward)
            keys_grads = (grad_k.flip(2), grad_v.flip(2), None, None)
        return (grad_q, *keys_grads, None, None, None, None, None, None, *tensor_grads)


def _headwise(
    rebuilt: HeadwiseRebuild, chain: _Chain, lse: torch.Tensor, inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The chain over a block rebuilt :data:`REBUILT_HEADS` heads at a time: each group's block (1,
    g, R, K) minus the log-sum-exp (B, g, R, K; in place for a batch of one), its dS given to the
    form (summed over the batch) before the next group is written; -> the form's tensors' gradients."""
    batch, rows, keys = chain.batch, chain.rows, chain.keys
    group = min(REBUILT_HEADS, chain.heads)
    dtype, device = lse.dtype, lse.device
    buffer = work_buffer(chain.buffers, "rebuilt_heads", group * rows * keys, torch.float32, device)
    shifted_rows = (
        None
        if batch == 1
        else work_buffer(chain.buffers, "rebuilt_rows", batch * group * rows * keys, dtype, device)
    )
    for heads, block in rebuilt.blocks(group, buffer):  # (1, g, R, K)
        count = heads.stop - heads.start
        if shifted_rows is None:
            scores = block.sub_(lse[:, heads, :, None])
        else:  # every batch row's (B, g, R, K), their dS summed for the shared bias
            scores = shifted_rows[: batch * count * rows * keys].view(batch, count, rows, keys)
            torch.sub(block, lse[:, heads, :, None], out=scores)
        chain.run(scores, heads)
        rebuilt.add_gradient(heads, scores if batch == 1 else scores.sum(0, keepdim=True))
    found = rebuilt.gradients()
    return [g if t.requires_grad else None for g, t in zip(found, inputs, strict=True)]


class _Chain:
    """FlashAttention-2's backward for one causal block from its kept statistics (see the module's
    docstring), a group of heads at a time over their log2(e) (bias - lse) (B, g, R, K), turned
    into dS in place; dq, dk, dv collected for :meth:`gradients`."""

    def __init__(self, q, k, v, out, lse, grad_out, scale: float, buffers: dict | None) -> None:
        (batch, heads, rows, dim), keys = q.shape, k.shape[2]
        self.batch, self.heads, self.rows, self.keys, self.dim = batch, heads, rows, keys, dim
        self.scale, self.buffers = scale, buffers
        self.q, self.k = q, k  # (B, H, R | K, D)
        # dO V^T - rowsum(dO * O) as one product: dO with -rowsum(dO * O) as one more column, V with ones
        self.grad_aug = torch.empty(batch, heads, rows, dim + 1, dtype=q.dtype, device=q.device)
        self.grad_aug[..., :dim].copy_(grad_out)
        torch.neg((grad_out * out).sum(-1), out=self.grad_aug[..., dim])
        self.v_aug = torch.ones(batch, heads, keys, dim + 1, dtype=q.dtype, device=q.device)
        self.v_aug[..., :dim].copy_(v)
        self.grad_q = torch.empty(batch, heads, rows, dim, dtype=q.dtype, device=q.device)
        # dk and dv transposed, (B, H, D, K): Q^T dS and dO^T P, products whose output rows are
        # contiguous, ran ~20 % faster than dS^T Q and P^T dO (4 heads of 256 x 2048, 2-vCPU VM of
        # 2026-11-28), and their transposed copies in :meth:`gradients` cost less than that gain
        self.grad_k = torch.empty(batch, heads, dim, keys, dtype=q.dtype, device=q.device)
        self.grad_v = torch.empty(batch, heads, dim, keys, dtype=q.dtype, device=q.device)

    def run(self, scores: torch.Tensor, heads: slice) -> None:
        """``scores`` (B, g, R, K) = bias - lse of the block's ``heads`` -> dS, in place, at most
        :data:`REBUILT_HEADS` heads at a time in batched products (``baddbmm_`` / ``bmm``): the
        threads split those heads between them, each writing whole (R, K) matrices."""
        scale, dim, rows, keys = self.scale, self.dim, self.rows, self.keys
        size = min(REBUILT_HEADS, heads.stop - heads.start)
        # dO V^T - delta of a group, (g, R, K), in a work buffer shared by the blocks (and layers) of a forward
        work = work_buffer(self.buffers, "grad_p", size * rows * keys, scores.dtype, scores.device)
        for first in range(heads.start, heads.stop, size):
            group = slice(first, min(first + size, heads.stop))  # the model's heads
            count = group.stop - group.start
            grad_p = work[: count * rows * keys].view(count, rows, keys)
            for b in range(self.batch):
                weights = scores[b, first - heads.start : group.stop - heads.start]  # (g, R, K)
                q, k = self.q[b, group], self.k[b, group]  # (g, R | K, D)
                weights.baddbmm_(q, k.transpose(1, 2), beta=LOG2E, alpha=scale * LOG2E)
                # weights below 2^FLUSH are 0: no subnormal P or dS (each costs ~100x in exp2, mul and BLAS)
                torch.threshold_(weights, FLUSH, -math.inf).exp2_()  # P
                grad_aug = self.grad_aug[b, group]  # (g, R, D + 1)
                # (P^T dO)^T = dO^T P, (g, D, K)
                torch.bmm(grad_aug[..., :dim].transpose(1, 2), weights, out=self.grad_v[b, group])
                torch.bmm(grad_aug, self.v_aug[b, group].transpose(1, 2), out=grad_p)
                weights.mul_(grad_p)  # dS = P * (dO V^T - delta)
                torch.bmm(weights, k, out=self.grad_q[b, group])
                torch.bmm(q.transpose(1, 2), weights, out=self.grad_k[b, group])  # (dS^T Q)^T = Q^T dS

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of every head run; dk and dv (B, H, K, D) views, not contiguous."""
        # dk and dv as (B, H, K, D) views of their transposed storage
        return (
            self.grad_q.mul_(self.scale),
            self.grad_k.mul_(self.scale).transpose(-1, -2),
            self.grad_v.transpose(-1, -2),
        )


class ReversedGradients:
    """One layer's k and v (B, H, Tk, D, no graph) over the keys in reverse order for its blocks'
    backward, and the sums of the gradients of those reversed copies, which the blocks' backward
    adds into (a causal block's keys 0 .. K-1 are the last K reversed keys) instead of returning
    them. Returned through autograd, each block's gradient to its slice of the reversed copies
    became a zero-filled (B, H, Tk, D) tensor that the engine then added up (FIRE at T=2048 in
    the bench's model: ~6 ms of a ~650 ms training step in fills and adds); flipped per block, k
    and v cost ~3 ms more. :class:`ReversedKeyValues` reads the sums once every block's backward
    has run, and drops the copies."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys_values = (k, v)
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None
        self._reversed: tuple[torch.Tensor, torch.Tensor] | None = None  # made by the first block asking

    def reversed_keys(self, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v of keys ``keys-1 .. 0`` (the last ``keys`` reversed keys, (B, H, keys, D) views)."""
        if self._reversed is None:
            k, v = self.keys_values
            self._reversed = (k.flip(2), v.flip(2))
        k_rev, v_rev = self._reversed
        return k_rev[:, :, k_rev.shape[2] - keys :], v_rev[:, :, v_rev.shape[2] - keys :]

    def add(self, grad_k: torch.Tensor, grad_v: torch.Tensor) -> None:
        """The gradients (B, H, K, D) of the last K reversed keys and values."""
        keys = grad_k.shape[2]
        if self.grad_k is None or self.grad_v is None:
            self.grad_k, self.grad_v = (torch.zeros_like(t) for t in self.keys_values)
        self.grad_k[:, :, -keys:].add_(grad_k)
        self.grad_v[:, :, -keys:].add_(grad_v)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sums (None where no block added), the copies dropped."""
        sums = (self.grad_k, self.grad_v)
        self.grad_k = self.grad_v = self._reversed = None
        return sums


class ReversedKeyValues(torch.autograd.Function):
    """k, v (B, H, Tk, D) -> the same over the keys in reverse order (copies; reversed key b is
    key Tk-1-b). Their gradients are what ``sink`` (a :class:`ReversedGradients`) collected
    from the blocks that attended views of them, plus any gradient autograd brings, flipped back.
    Autograd runs this backward after every block that took the copies as inputs (each block
    returns None for them), so the sums are complete."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, sink: ReversedGradients):
        ctx.set_materialize_grads(False)
        ctx.sink = sink
        return k.flip(2), v.flip(2)

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
        grads = []
        for given, collected in zip((grad_k, grad_v), ctx.sink.take(), strict=True):
            total = collected if given is None else (given if collected is None else collected.add_(given))
            grads.append(None if total is None else total.flip(2))
        return grads[0], grads[1], None
