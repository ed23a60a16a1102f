"""One query block of attention with its bias written out as a float mask, and the gradients
that bias needs (the chunked backend's blocks, :mod:`.chunked`):

- :func:`block_attention`: SDPA of the block; a bias that needs its gradient goes through
  :class:`BiasedBlockAttention` (the fused kernel forward, backward recomputing the block's
  weights once, :func:`block_gradients`), not SDPA's math path, which keeps the block's weights;
- :class:`RebuiltBiasAttention`: the block's bias rebuilt in backward from its form's tensors
  instead of kept (:func:`differentiable_copies` and :func:`tensor_gradients`, which
  :class:`~.rebuilt_flash.RebuiltBiasFlashAttention` shares).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BiasedBlockAttention(torch.autograd.Function):
    """SDPA of one query block with an additive float ``bias`` that needs its gradient.

    SDPA on CPU differentiates a float mask only on its math path, which keeps the block's
    (B, H, rows, keys) attention weights until backward. Here forward is the fused kernel with
    the bias as a plain mask (nothing kept but q, k, v, the output and the bias as given: on
    the Toeplitz path a strided view of one O(T) line), and backward recomputes the block's
    weights P once and returns the textbook gradients (dS = P * (dO V^T - rowsum(dO * O))):
    dq = dS K s, dk = dS^T Q s, dv = P^T dO, dbias = dS summed over the batch (the Toeplitz
    view's own backward then sums it along anti-diagonals). Computed in fp32; never with
    dropout (SDPA's own path serves those calls).

    ``reverse``: the block attends ``k`` and ``v`` in reverse order along the keys (the Toeplitz
    path's key order), flipped here per block and again in backward, so that what is kept is a
    view of the layer's own keys and values, not of reversed copies of them (two (B, H, T, D)
    tensors per layer that training would keep beside the originals).
    """

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
        reverse=False,
    ):
        keys, values = (k.flip(-2), v.flip(-2)) if reverse else (k, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.detach(), scale=scale)
        ctx.save_for_backward(q, k, v, bias, out)
        ctx.scale, ctx.reverse = scale, reverse
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, bias, out = ctx.saved_tensors
        if ctx.reverse:
            k, v = k.flip(-2), v.flip(-2)
        grad_q, grad_k, grad_v, grad_scores = block_gradients(q, k, v, bias, out, grad_out, ctx.scale)
        if ctx.reverse:
            grad_k, grad_v = grad_k.flip(-2), grad_v.flip(-2)
        grad_bias = grad_scores.sum_to_size(bias.shape).to(bias.dtype) if ctx.needs_input_grad[3] else None
        return grad_q, grad_k, grad_v, grad_bias, None, None


def block_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block's softmax(q k^T * scale + bias) v: dq, dk, dv (q's dtype) and
    dS (fp32, (B, H, rows, keys), the gradient of the scores and so of the bias)."""
    dtype = q.dtype
    qf, kf, vf, grad = q.float(), k.float(), v.float(), grad_out.float()
    # the scale on q and k (rows/keys x D) rather than on the (rows, keys) scores: one pass fewer
    scores = torch.matmul(qf * scale, kf.transpose(-1, -2)).add_(bias.float())  # (B, H, rows, keys)
    weights = torch.softmax(scores, dim=-1)  # P
    del scores
    grad_v = torch.matmul(weights.transpose(-1, -2), grad)
    row = (grad * out.float()).sum(-1, keepdim=True)  # (B, H, rows, 1)
    grad_scores = weights.mul_(torch.matmul(grad, vf.transpose(-1, -2)).sub_(row))  # dS, over P
    grad_q = torch.matmul(grad_scores, kf * scale)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qf * scale)
    return grad_q.to(dtype), grad_k.to(dtype), grad_v.to(dtype), grad_scores


class RebuiltBiasAttention(torch.autograd.Function):
    """SDPA of one block whose bias is rebuilt in backward instead of kept (a form's
    :meth:`BlockBias.tensors`): forward builds the block's float mask without gradients and
    runs SDPA's fused kernel; backward builds it again from the form's tensors with gradients,
    takes :func:`block_gradients` and sends dS through the rebuild. Training keeps no more
    than one block of bias, as activation checkpointing would, without running the block's
    SDPA forward a second time. ``build(*tensors) -> (B|1, H, rows, keys)``; no dropout.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, build, *tensors: torch.Tensor):
        with torch.no_grad():
            bias = build(*tensors)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        ctx.scale, ctx.build = scale, build
        ctx.save_for_backward(q, k, v, out, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, *tensors = ctx.saved_tensors
        inputs = differentiable_copies(tensors, ctx.needs_input_grad[5:])
        with torch.enable_grad():
            bias = ctx.build(*inputs)
        grad_q, grad_k, grad_v, grad_scores = block_gradients(
            q, k, v, bias.detach(), out, grad_out, ctx.scale
        )
        return (grad_q, grad_k, grad_v, None, None, *tensor_gradients(bias, inputs, grad_scores))


def differentiable_copies(tensors: list[torch.Tensor], needs: tuple[bool, ...]) -> list[torch.Tensor]:
    """A rebuilt bias's inputs in backward: each of a form's tensors detached, requiring its
    gradient where the autograd function's input needs one."""
    return [t.detach().requires_grad_(n) for t, n in zip(tensors, needs, strict=True)]


def tensor_gradients(
    bias: torch.Tensor, inputs: list[torch.Tensor], grad_scores: torch.Tensor
) -> list[torch.Tensor | None]:
    """The gradients of a form's tensors ``inputs`` (:func:`differentiable_copies`) that ``bias``
    was rebuilt from, given the scores' gradient dS (summed to the bias's shape: a bias shared
    by the batch); None for those that need none."""
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted or not bias.requires_grad:
        return [None] * len(inputs)
    grad_bias = grad_scores.sum_to_size(bias.shape).to(bias.dtype)
    found = iter(torch.autograd.grad(bias, wanted, grad_bias, allow_unused=True))
    return [next(found) if t.requires_grad else None for t in inputs]


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, dropout_p: float
) -> torch.Tensor:
    """SDPA of one block with a float ``bias`` mask (B|1, H, rows, keys); a bias that needs its
    gradient goes through :class:`BiasedBlockAttention` (fused forward, no kept weights)."""
    if bias.requires_grad and dropout_p == 0.0 and torch.is_grad_enabled():
        return BiasedBlockAttention.apply(q, k, v, bias, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
