"""One causal query block whose bias is written out per block (FIRE past its threshold) and needs
its gradient, trained on torch's fused CPU flash-attention kernel with the block's log-sum-exp
kept, on CPU in fp32/fp64 without a padding mask (:class:`RebuiltBiasFlashAttention`).

Forward: the block's bias built without gradients (into the chunked backend's shared buffer;
over the keys in reverse order where the form builds it cheaper that way, FIRE on CPU, with k
and v in that order: the chunked backend hands them so too, views of one reversed copy per
layer), the fused kernel ``_scaled_dot_product_flash_attention_for_cpu`` with it as the mask,
which also returns the rows' log-sum-exp. Kept for backward: q, k, v, the output, the
log-sum-exp (O(rows)) and the bias form's O(T) tensors, as
:class:`~.bias_block.RebuiltBiasAttention` keeps.

Backward: the bias built once more, with gradients, from the form's tensors (over the keys in
reverse order where the form rebuilds it so, FIRE's bands of distances: the kept k and v
flipped, and dk, dv the gradients of the reversed copies), and the FlashAttention-2 gradients
from the kept statistics (Dao 2023, Algorithm 2):

    P = exp(s Q K^T + bias - lse),  dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),
    dQ = s dS K,  dK = s dS^T Q,  dbias = dS (summed over a batch the bias is shared by)

computed in one (B, H, R, K) buffer: bias - lse written there, then ``baddbmm_`` adds the
scores (the exponent in base 2: log2(e) times it), weights below 2^-100 flushed to 0 and
``exp2_`` (torch's exp leaves its fast path for inputs below about -87 and for the masked
keys, see :mod:`hf_posenc.core.underflow`), multiplied in place by dO V^T - rowsum(dO * O)
(one product of dO widened by a column of -rowsum(dO * O) and V widened by ones), and dbias
sent through the rebuilt bias's own backward. No softmax (the statistics are kept) and no
second forward; the block's (rows x keys) buffers exist only while it is computed.

Before, the block's backward recomputed its weights by a softmax of explicitly recomputed
scores (:func:`~.bias_block.block_gradients`) and built its bias twice (once without gradients
in forward, once with them in backward, which stays).
"""

from __future__ import annotations

import math

import torch

from .bias_block import differentiable_copies, tensor_gradients
from .softmax_parts import CPU_FLASH
from .toeplitz_layout import FLUSH, LOG2E, work_buffer

#: dtypes the block's forward and backward run in (the fused kernel computes in them)
FLASH_DTYPES = (torch.float32, torch.float64)


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
    the keys in reverse order (views of one reversed copy of the layer's: forward attends them
    where the bias comes so, and backward gives them their gradients, with no flip per block;
    the copies are not kept, k and v are), ``build(*tensors)`` -> its bias
    (B|1, H, R, K) in q's dtype (the future keys at the dtype's minimum), ``build_reversed()``
    -> the same over the keys in reverse order, without gradients, or None (then forward
    takes ``build``; either may be given as None / return None), ``rebuild_reversed(*tensors)``
    -> the reversed block with gradients for backward, or None (then backward takes ``build``;
    may be None too), ``buffers`` (a dict
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
        scale: float,
        build,
        build_reversed,
        rebuild_reversed,
        buffers: dict | None,
        *tensors: torch.Tensor,
    ):
        assert CPU_FLASH is not None
        ctx.given_reversed = k_reversed is not None
        with torch.no_grad():
            # over the keys in reverse order where the form builds that cheaper (attention does not
            # depend on the keys' order; k and v in that order, (B, H, K, D) each)
            backwards = None if build_reversed is None else build_reversed()
            if backwards is not None:
                if k_reversed is None:
                    k_reversed, v_reversed = k.flip(2), v.flip(2)
                out, lse = CPU_FLASH(q, k_reversed, v_reversed, 0.0, False, attn_mask=backwards, scale=scale)
            else:
                out, lse = CPU_FLASH(q, k, v, 0.0, False, attn_mask=build(*tensors), scale=scale)
        ctx.scale, ctx.build, ctx.rebuild_reversed, ctx.buffers = scale, build, rebuild_reversed, buffers
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        scale = ctx.scale
        inputs = differentiable_copies(tensors, ctx.needs_input_grad[10:])
        with torch.enable_grad():
            # (B|1, H, R, K), with gradients to the form's tensors: over the keys in reverse order
            # where the form rebuilds it so (then k and v flipped here, dk and dv to the reversed copies)
            bias = None if ctx.rebuild_reversed is None else ctx.rebuild_reversed(*inputs)
            reverse = bias is not None
            if bias is None:
                bias = ctx.build(*inputs)
        if reverse:
            k, v = k.flip(2), v.flip(2)
        (batch, heads, rows, dim), keys = q.shape, k.shape[2]
        bh = batch * heads
        q3, k3 = q.reshape(bh, rows, dim), k.reshape(bh, keys, dim)
        # dO V^T - rowsum(dO * O) as one product: dO with -rowsum(dO * O) as one more column, V with ones
        grad_aug = torch.empty(bh, rows, dim + 1, dtype=q.dtype, device=q.device)
        grad_aug[..., :dim].copy_(grad_out.reshape(bh, rows, dim))
        torch.neg((grad_out * out).sum(-1).reshape(bh, rows), out=grad_aug[..., dim])
        grad3 = grad_aug[..., :dim]
        v_aug = torch.ones(bh, keys, dim + 1, dtype=q.dtype, device=q.device)
        v_aug[..., :dim].copy_(v.reshape(bh, keys, dim))
        # log2(e) (bias - lse + s q k^T): bias - lse first (a masked key's minimum stays finite),
        # in place when the bias has the batch's rows (its backward reads none of its values)
        scores = bias.detach()
        if scores.shape[0] == batch and scores.is_contiguous():
            scores.sub_(lse[..., None])
        else:
            scores = torch.sub(scores, lse[..., None])  # (B, H, R, K)
        s3 = scores.view(bh, rows, keys)
        s3.baddbmm_(q3, k3.transpose(1, 2), beta=LOG2E, alpha=scale * LOG2E)
        # weights below 2^FLUSH are 0: no subnormal P or dS (each costs ~100x in exp2, mul and BLAS)
        torch.threshold_(s3, FLUSH, -math.inf).exp2_()  # P
        grad_v = torch.bmm(s3.transpose(1, 2), grad3)  # (BH, K, D) P^T dO
        # dO V^T - delta in a work buffer shared by the blocks (and layers) of one forward
        grad_p = work_buffer(ctx.buffers, "grad_p", bh * rows * keys, q.dtype, q.device)
        grad_p = torch.bmm(
            grad_aug, v_aug.transpose(1, 2), out=grad_p[: bh * rows * keys].view(bh, rows, keys)
        )
        s3.mul_(grad_p)  # dS = P * (dO V^T - delta)
        grad_q = torch.bmm(s3, k3).mul_(scale)
        grad_k = torch.bmm(s3.transpose(1, 2), q3).mul_(scale)
        tensor_grads = tensor_gradients(bias, inputs, scores)  # scores: (B, H, R, K) dS
        grad_k, grad_v = grad_k.view(k.shape), grad_v.view(v.shape)
        # to the k and v given in the bias's order; the others get None
        keys_grads = (None, None, grad_k, grad_v) if reverse else (grad_k, grad_v, None, None)
        if reverse and not ctx.given_reversed:  # (flipped in forward)
            keys_grads = (grad_k.flip(2), grad_v.flip(2), None, None)
        return (grad_q.view(q.shape), *keys_grads, None, None, None, None, None, *tensor_grads)
