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

#: eigenvalues of one block closer than this (relative to the block's largest, at least 1) mean
#: "not separable": eigh's gradient grows like 1 / gap, and a null eigenvalue has no pair
SEPARATION = 1e-7
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
    (Hkv|1, dim, dim), ``cos``/``sin`` (B, Hkv|1, T, dim); the query heads of a group share theirs."""
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
