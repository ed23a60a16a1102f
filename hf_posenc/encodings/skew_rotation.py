"""exp(w S) of skew-symmetric blocks S at every position, at the cost of RoPE (issue 21.5).

LieRE and ComRoPE rotate each block of ``b`` dims of q and k by ``R = exp(w S)``, where S is a
learned skew-symmetric (b x b) generator and ``w`` a scalar per token and block (the position,
or ComRoPE's ``sum_a x_a c_aj``). A matrix exponential per token keeps a (T, b, b) rotation per
block and head; instead each S is decomposed once per forward:

    i S = U diag(mu) U^H   (Hermitian: ``torch.linalg.eigh``; eigenvalues come in pairs +-mu)

For each of the b/2 positive eigenvalues mu_k with eigenvector u_k = a_k + i c_k,
``S a_k = mu_k c_k`` and ``S c_k = -mu_k a_k``, and {sqrt(2) a_k, sqrt(2) c_k} is an orthonormal
basis V (b x b, real) in which S is RoPE's generator with frequencies mu_k. So

    exp(w S) x = V rot(w mu) V^T x,    rot: z -> z * (cos, cos) + rotate_half(z) * (sin, sin)

per token: two small (b x b) products and RoPE's elementwise rotation, with (T, b/2) angles per
block and head — no (T, b, b) tensor. The decomposition runs in fp64 (small matrices: the
eigenvectors of nearly equal eigenvalues, e.g. RoPE's lowest frequencies ~1e-6 apart for a
large theta, stay accurate) and is differentiable (``eigh``'s gradient is well defined while
the eigenvalues are distinct; exp(w S) does not depend on the eigenvectors' phases). When two
eigenvalues of a block come too close (a repeated frequency, or one near 0, where the
eigenvectors stop being unique and eigh's gradient blows up), :func:`eigenbasis` returns None
and the caller keeps the per-position ``matrix_exp`` (as it does under ``torch.compile``, where that
test would be a data-dependent branch).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

#: eigenvalues of one block closer than this (relative to the block's largest, at least 1) mean
#: "not separable": eigh's gradient grows like 1 / gap, and a null eigenvalue has no pair
SEPARATION = 1e-7
#: calls of at most this many tokens without gradients (decoding steps) turn q and k together
#: (:func:`_rotate_few`): one query, 8 heads of 32 (CPU), 0.44 ms a layer one after the other,
#: 0.17-0.25 ms together
FEW_TOKENS = 16
_EXACT = torch.float64


def decomposition_dtype(device: torch.device) -> torch.dtype:
    """fp64 where the device has it (MPS does not: fp32 there)."""
    return torch.float32 if device.type == "mps" else _EXACT


def eigenbasis(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """skew (..., b, b) skew-symmetric -> (V (..., b, b), mu (..., b/2)) in fp64 with
    S = V J(mu) V^T, J the block form of RoPE's generator (first half of V's columns: the a_k,
    second half: the c_k); None when some block's eigenvalues are not well separated."""
    if torch.compiler.is_compiling():
        # whether the blocks separate is data-dependent (no fullgraph compile, no inductor): a
        # compiled forward keeps the per-position matrix_exp, exact for any generator and cheap
        # for the few tokens of a compiled decoding step
        return None
    dtype = decomposition_dtype(skew.device)
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    hermitian = skew.to(dtype).to(complex_dtype) * 1j  # (..., b, b)
    mu, vectors = torch.linalg.eigh(hermitian)  # ascending: -mu_max .. -mu_min, mu_min .. mu_max
    half = skew.shape[-1] // 2
    scale = mu.detach().abs().amax(-1, keepdim=True).clamp_min(1.0)
    gaps = mu.detach().diff(dim=-1) / scale  # includes the gap 2 mu_min around 0
    if bool((gaps < SEPARATION).any()):
        return None
    positive = vectors[..., half:]  # (..., b, b/2): eigenvectors of +mu_k
    basis = torch.cat((positive.real, positive.imag), dim=-1) * 2**0.5  # (..., b, b) = (a_k | c_k)
    return basis, mu[..., half:]


def rotate_blocks(blocks: torch.Tensor, basis: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """exp(w S) applied to ``blocks`` (B, H, T, m, b), with S = V J(mu) V^T of ``basis`` V
    (H, m, b, b) and ``angles`` = w mu (B|1, H|1, T, m, b/2) -> (B, H, T, m, b) (the definition,
    block by block; the encodings use :func:`dense_basis` and :func:`rotate_dense`)."""
    dtype = blocks.dtype
    basis = basis.to(dtype)
    z = torch.einsum("bhtmi,hmij->bhtmj", blocks, basis)  # V^T x
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    z_a, z_c = z.chunk(2, dim=-1)  # coordinates on the a_k and on the c_k
    turned = torch.cat((z_a * cos - z_c * sin, z_a * sin + z_c * cos), dim=-1)  # rot(w mu) z
    return torch.einsum("bhtmj,hmij->bhtmi", turned, basis)  # V z'


def dense_basis(basis: torch.Tensor) -> torch.Tensor:
    """Block bases V (H, m, b, b) -> one (H, m b, m b) matrix W: row ``n b + i`` is dim i of block
    n; column ``n b/2 + k`` its a_k, column ``m b/2 + n b/2 + k`` its c_k. So z = x W puts every
    block's a-coordinates in the first half and c-coordinates in the second, the layout of
    RoPE's ``rotate_half``, and one (T, d) x (d, d) product per head replaces m small ones
    (no permutation of q or k in memory)."""
    heads, m, b, _ = basis.shape
    eye = torch.eye(m, dtype=basis.dtype, device=basis.device)
    halves = [
        torch.einsum("hnik,nl->hnilk", part, eye).reshape(heads, m * b, m * b // 2)
        for part in basis.split(b // 2, dim=-1)  # a columns, c columns
    ]
    return torch.cat(halves, dim=-1)  # (H, m b, m b)


def rotate_dense(x: torch.Tensor, dense: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., H, T, d) -> W rot W^T x per head: ``dense`` W (H, d, d) from :func:`dense_basis`
    (rows in x's dim order), ``cos``/``sin`` (..., H|1, T, d) of the angles, duplicated over the
    two halves (RoPE's layout). All in x's dtype."""
    z = x @ dense  # (..., H, T, d): coordinates in the eigenbasis
    z1, z2 = z.chunk(2, dim=-1)
    turned = z * cos + torch.cat((-z2, z1), dim=-1) * sin  # RoPE's rotation of z
    return turned @ dense.transpose(-1, -2)


def rotate_pairs(
    x: torch.Tensor, dim: int, dense: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x (B, H, T, D) with its first ``dim`` dims turned by W rot W^T per KV head (fp32): ``dense``
    (Hkv|1, dim, dim), ``cos``/``sin`` (B, Hkv|1, T, dim); the query heads of a group share theirs
    (the definition through autograd; the encodings use :func:`rotate_qk`)."""
    batch, heads, length, _ = x.shape
    kv_heads = dense.shape[0]
    rotated, passed = x[..., :dim].float(), x[..., dim:]
    if kv_heads == 1:  # one set of generators: every head alike
        out = rotate_dense(rotated, dense, cos, sin)
    else:  # (B, Hkv, G, T, dim): no copy of the queries per group
        grouped = rotated.reshape(batch, kv_heads, heads // kv_heads, length, dim)
        out = rotate_dense(grouped, dense[:, None], cos[:, :, None], sin[:, :, None]).flatten(1, 2)
    out = out.to(x.dtype)
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, d) -> (B, Hkv|1, G, T, d), a view (the query heads of a KV head side by side)."""
    batch, heads, length, dim = x.shape
    groups = heads // kv_heads
    return x.reshape(batch, heads // groups, groups, length, dim)


def _half_turn(z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of z (..., d) by the angles of ``cos``/``sin`` (..., d/2): pair (k, k + d/2).
    Written half by half into one new tensor (z1 cos - z2 sin, then z1 sin + z2 cos), so it holds
    the result and one half-size product at a time, where four products, a difference, a sum and
    a concatenation held up to twice z's size at once. (The same products, difference and sum as
    those: an ``addcmul_`` rounds differently and moved cached decoding's logits by ~2e-6.)"""
    z1, z2 = z.chunk(2, dim=-1)
    out = z.new_empty(_broadcast(z.shape, cos.shape))
    first, second = out.chunk(2, dim=-1)
    torch.mul(z1, cos, out=first)
    first.sub_(z2 * sin)
    torch.mul(z1, sin, out=second)
    second.add_(z2 * cos)
    return out


def _broadcast(shape: torch.Size, angle_shape: torch.Size) -> tuple[int, ...]:
    """``shape`` (..., d) broadcast with the angles' leading dims (..., d/2), both of one rank
    (:func:`_grouped` and :func:`_trig`'s layouts): torch.broadcast_shapes runs ~50 us of Python per
    call, two per layer of every decoding step."""
    if len(shape) != len(angle_shape):
        return tuple(torch.broadcast_shapes(shape, (*angle_shape[:-1], shape[-1])))
    leading = (a if b == 1 else b for a, b in zip(shape[:-1], angle_shape[:-1], strict=True))
    return (*leading, shape[-1])


def _trig(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """angles (B|1, H|1, T, n) in their own dtype (fp64 where asked) -> fp32 cos, sin (B|1, H|1, 1, T, n)."""
    return angles.cos().float()[:, :, None], angles.sin().float()[:, :, None]


class _RotateQK(torch.autograd.Function):
    """(q, k) -> (W rot(theta) W^T q, W rot(theta) W^T k) per KV head, fp32 inside, keeping for
    backward only what the attention keeps anyway (issue 21.5).

    Through autograd each rotation kept x, z = x W, rotate_half(z), rot(theta) z and cos/sin:
    about four (B, H, T, d) fp32 tensors per q and per k and layer, 1.5x the native model's
    training memory. W is orthogonal, so backward recomputes them from the rotated output y:
    t = rot(theta) z = y W, z = rot(-theta) t. With g = dy W (the gradient of t):

        dx = W rot(-theta) g
        dW = W (z^T rot(-theta) g) + dy^T t      (x^T dz with x = z W^T, plus y = t W^T's term)
        dtheta_k = g_{k+d/2} t_k - g_k t_{k+d/2}

    In fp32 y is the tensor SDPA saves too (no copy); in lower precision y is rounded, so the
    input x is kept instead and z recomputed (one (B, H, T, d) tensor per q and k). The output
    has the input's memory layout (native RoPE's elementwise rotation keeps the projections'
    (B, T, H, D) layout, so SDPA's output needs no copy before ``o_proj``).
    """

    @staticmethod
    def forward(ctx, q, k, dense, angles):
        # q (B, Hq, T, d), k (B, Hkv, T, d), dense W (Hkv|1, d, d) fp32, angles (B|1, Hkv|1, T, d/2)
        kv_heads = dense.shape[0]
        cos, sin = _trig(angles)  # (B|1, Hkv|1, 1, T, d/2) fp32
        outs = []
        for x in (q, k):
            z = _grouped(x, kv_heads).float() @ dense[:, None]  # (B, Hkv|1, G, T, d)
            turned = _half_turn(z, cos, sin)  # (B, Hkv|1, G, T, d)
            # y = turned W^T into z's buffer (z is not needed any more): one (B, H, T, d) tensor
            # fewer alive at the forward's peak
            torch.matmul(turned, dense[:, None].transpose(-1, -2), out=z)
            del turned
            out = torch.empty_like(x)  # the input's layout and dtype
            out.copy_(z.flatten(1, 2))
            del z  # before the next tensor's z
            outs.append(out)
        ctx.exact = q.dtype == torch.float32
        ctx.save_for_backward(*(outs if ctx.exact else (q, k)), dense, angles)
        return tuple(outs)

    @staticmethod
    @once_differentiable  # uses W^T W = I: a double backward would differentiate that
    def backward(ctx, grad_q, grad_k):
        first, second, dense, angles = ctx.saved_tensors
        kv_heads = dense.shape[0]
        w = dense[:, None]  # (Hkv|1, 1, d, d)
        cos, sin = _trig(angles)  # (B|1, Hkv|1, 1, T, d/2) fp32
        grads = []
        grad_dense = torch.zeros_like(dense)
        grad_angles = torch.zeros_like(angles, dtype=torch.float32)
        for saved, grad in ((first, grad_q), (second, grad_k)):
            if grad is None:
                grads.append(None)
                continue
            dy = _grouped(grad, kv_heads).float()  # (B, Hkv|1, G, T, d)
            if ctx.exact:  # saved: the output y
                t = _grouped(saved, kv_heads) @ w  # rot(theta) z
                z = _half_turn(t, cos, -sin)
            else:  # saved: the input x
                z = _grouped(saved, kv_heads).float() @ w
                t = _half_turn(z, cos, sin)
            g = dy @ w  # gradient of t
            dz = _half_turn(g, cos, -sin)  # rot(-theta) g
            grads.append((dz @ w.transpose(-1, -2)).flatten(1, 2).to(saved.dtype))
            if ctx.needs_input_grad[2]:
                inner = (z.transpose(-1, -2) @ dz).sum(dim=(0, 2))  # (Hkv|1, d, d)
                outer = (dy.transpose(-1, -2) @ t).sum(dim=(0, 2))
                grad_dense += (dense @ inner + outer).sum_to_size(dense.shape)
            if ctx.needs_input_grad[3]:
                t1, t2 = t.chunk(2, dim=-1)
                g1, g2 = g.chunk(2, dim=-1)
                grad_angles += (g2 * t1 - g1 * t2).sum(dim=2).sum_to_size(angles.shape)
        return grads[0], grads[1], grad_dense, grad_angles.to(angles.dtype)


def _rotate_few(
    q: torch.Tensor, k: torch.Tensor, dense: torch.Tensor, angles: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`_RotateQK`'s forward for a call of few tokens without gradients (a decoding step):
    q and k side by side, so each product and the turn is one operation for both (a step's cost is
    its count of operations; the autograd function turns q, then k, to keep one tensor fewer at a
    long forward's peak)."""
    kv_heads = dense.shape[0]
    groups = _grouped(q, kv_heads).shape[2]
    cos, sin = _trig(angles)  # (B|1, Hkv|1, 1, T, d/2) fp32
    both = torch.cat((_grouped(q, kv_heads), _grouped(k, kv_heads)), dim=2).float()  # (B, Hkv|1, G + g, T, d)
    turned = _half_turn(both @ dense[:, None], cos, sin)  # rot(theta) z
    out = turned @ dense[:, None].transpose(-1, -2)  # (B, Hkv|1, G + g, T, d)
    return out[:, :, :groups].flatten(1, 2).to(q.dtype), out[:, :, groups:].flatten(1, 2).to(k.dtype)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, dim: int, dense: torch.Tensor, angles: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, T, D), k (B, Hkv, T, D) with their first ``dim`` dims turned by W rot(theta) W^T
    per KV head: ``dense`` W (Hkv|1, dim, dim) fp32 from :func:`dense_basis` (rows in the dims'
    order), ``angles`` theta (B|1, Hkv|1, T, dim/2) fp32 or fp64 (cos/sin taken in it; column k of W's halves turns by
    theta_k); the query heads of a group share their KV head's. Computed in fp32, returned in
    q's and k's dtype; equals :func:`rotate_pairs` with cos/sin of the angles duplicated over
    the two halves, at the memory cost of RoPE (see :class:`_RotateQK`)."""
    turn = _rotate_few if q.shape[-2] <= FEW_TOKENS and not torch.is_grad_enabled() else _RotateQK.apply
    if dim == q.shape[-1]:
        return turn(q, k, dense, angles)
    q_rot, k_rot = turn(q[..., :dim], k[..., :dim], dense, angles)
    return torch.cat((q_rot, q[..., dim:]), dim=-1), torch.cat((k_rot, k[..., dim:]), dim=-1)
