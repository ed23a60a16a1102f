"""One attention layer written out with loops in fp64, from the module's own weights: the q/k/v
projections read from the module's structure, softmax over the allowed keys (causal, and the
sliding window when the layer has one), the output projection. Every encoding's reference is one
of these loops with the encoding's formula plugged in (a score bias, a rotation, an input
override, or its own attention weights). Nothing here imports hf_posenc."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x @ W^T (+ b) in float64, for an nn.Linear (weight (out, in), bias optional)."""
    out = x @ layer.weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """Zhang & Sennrich 2019: x / sqrt(mean(x^2) + eps) * weight, over the last dim; Gemma's
    norms store weight - 1 (they scale by 1 + weight, zero-initialised)."""
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    weight = norm.weight.double() + (1.0 if type(norm).__name__.startswith("Gemma") else 0.0)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def projections(module, x_qk: torch.Tensor, x_v: torch.Tensor):
    """q, k, v as (B, T, heads, head_dim) float64, from the module's own weights, read from its
    structure: a fused Conv1D ``c_attn`` (GPT-2: weight (in, 3*out) plus bias), a fused linear
    ``qkv_proj`` (Phi-3: q, k, v stacked on the output dim), or separate
    ``q_proj``/``k_proj``/``v_proj`` linears (with their biases when present), followed by the
    q/k RMSNorms when the module has them — over each head when the norm's weight has head_dim
    entries (Qwen3), over the whole projection otherwise (OLMo 2)."""
    d_head = module.head_dim
    split = lambda t: t.reshape(*t.shape[:-1], -1, d_head)  # noqa: E731  (B, T, H, D)
    if hasattr(module, "c_attn"):
        w, b = module.c_attn.weight.double(), module.c_attn.bias.double()  # (d, 3d)
        d = w.shape[0]
        q = x_qk @ w[:, :d] + b[:d]
        k = x_qk @ w[:, d : 2 * d] + b[d : 2 * d]
        v = x_v @ w[:, 2 * d :] + b[2 * d :]
        return split(q), split(k), split(v)
    if hasattr(module, "qkv_proj"):  # Phi-3: q, k, v concatenated on the output dim, no bias
        w = module.qkv_proj.weight.double()  # ((Hq + 2 Hkv) D, d)
        kv = (w.shape[0] - module.config.num_attention_heads * d_head) // 2
        q_w, k_w, v_w = (
            w[: w.shape[0] - 2 * kv],
            w[w.shape[0] - 2 * kv : w.shape[0] - kv],
            w[w.shape[0] - kv :],
        )
        return split(x_qk @ q_w.T), split(x_qk @ k_w.T), split(x_v @ v_w.T)
    q, k, v = _linear(x_qk, module.q_proj), _linear(x_qk, module.k_proj), _linear(x_v, module.v_proj)
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    per_head = q_norm is not None and q_norm.weight.numel() == d_head
    if q_norm is not None and not per_head:
        q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)
    q, k, v = split(q), split(k), split(v)
    if per_head:
        q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)
    return q, k, v


def output_projection(module, merged: torch.Tensor) -> torch.Tensor:
    """The output projection of merged heads (B, T, H*D): ``c_proj`` (Conv1D) or ``o_proj``."""
    if hasattr(module, "c_proj"):
        return merged @ module.c_proj.weight.double() + module.c_proj.bias.double()
    return _linear(merged, module.o_proj)


def allowed_keys(i: int, window: int | None) -> list[int]:
    """The keys query i attends to: j <= i, and i - j < window when a sliding window is set."""
    return [j for j in range(i + 1) if window is None or i - j < window]


@torch.no_grad()
def attention_layer(
    module,
    hidden: torch.Tensor,
    *,
    softmax_scale: float,
    window: int | None = None,
    x_override=None,
    override_value: bool = False,
    rotation=None,
    key_rotation=None,
    bias=None,
) -> torch.Tensor:
    """softmax_j(q_i . k_j * softmax_scale + bias(h, i, j)) v_j over allowed j, then the output projection.

    ``x_override(t) -> list`` replaces the leading dims of the q/k input of token t;
    ``rotation(t, i) -> (D, D)`` rotates q_t and k_t for query i (frequencies may depend on
    the query, as in causal dynamic NTK); ``key_rotation(t, i)``, when given, maps k_t instead
    (xPos scales queries and keys differently); ``bias(h, i, j) -> float``.
    """
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    x_qk, x_v = hidden.clone(), hidden
    if x_override is not None:
        for t in range(length):
            values = torch.tensor(x_override(t), dtype=torch.float64)
            x_qk[:, t, : len(values)] = values
        if override_value:
            x_v = x_qk
    q, k, v = projections(module, x_qk, x_v)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)  # the KV head serving query head h
            for i in range(length):
                qi = rotation(i, i) @ q[b, i, h] if rotation else q[b, i, h]
                keys = allowed_keys(i, window)
                scores = []
                for j in keys:
                    key_map = key_rotation or rotation
                    kj = key_map(j, i) @ k[b, j, g] if key_map else k[b, j, g]
                    scores.append(float(qi @ kj) * softmax_scale + (bias(h, i, j) if bias else 0.0))
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
    return output_projection(module, out.reshape(batch, length, -1))


@torch.no_grad()
def attention_with_matrices(
    module, hidden: torch.Tensor, *, window: int | None, matrix: Callable[[int, int, int], torch.Tensor]
) -> torch.Tensor:
    """softmax_j((M(b, g, i) q_i) . (M(b, g, j) k_j) * scaling) v_j over allowed j, per query head h
    with KV head g = h // group; ``matrix(b, g, t)`` is the (D, D) positional map of token t of
    batch row b (learned per KV head for LieRE, FoPE, ComRoPE; of caller coordinates for rope2d)."""
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    q, k, v = projections(module, hidden, hidden)  # (B, T, H, D)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            keys_rot = [matrix(b, g, j) @ k[b, j, g] for j in range(length)]
            for i in range(length):
                qi = matrix(b, g, i) @ q[b, i, h]
                keys = allowed_keys(i, window)
                scores = [float(qi @ keys_rot[j]) * module.scaling for j in keys]
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
    return output_projection(module, out.reshape(batch, length, -1))


@torch.no_grad()
def attention_from_weights(module, hidden: torch.Tensor, *, window: int | None, weights) -> torch.Tensor:
    """sum_j A_hij v_j over allowed j, then the output projection, for encodings that compute the
    attention weights themselves (CoPE, stick-breaking, CAPE): ``weights(b, i, keys, q, k)`` gives
    one row of weights over ``keys`` per query head, from q (B, T, H, D) and k (B, T, Hkv, D)."""
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    q, k, v = projections(module, hidden, hidden)  # (B, T, H, D)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for i in range(length):
            keys = allowed_keys(i, window)
            rows = weights(b, i, keys, q, k)
            for h in range(heads):
                g = h // (heads // kv_heads)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(rows[h], keys, strict=True))
    return output_projection(module, out.reshape(batch, length, -1))


@torch.no_grad()
def two_map_attention_layer(
    module,
    hidden: torch.Tensor,
    *,
    softmax_scale: float,
    window: int | None,
    rotation,
    positions,
    query_scale=None,
) -> torch.Tensor:
    """softmax_j((R(a) q_i) . (R(b) k_j) * softmax_scale) v_j with ``(a, b) = positions(i, j)``: RoPE
    where the rotation of both query and key depends on the pair (SelfExtend, ReRoPE).
    ``rotation(p) -> (D, D)`` is the RoPE matrix of position p (None: no rotation);
    ``query_scale(i) -> float``, when given, multiplies q_i (ReRoPE's log-n scaling)."""
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    q, k, v = projections(module, hidden, hidden)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                keys = allowed_keys(i, window)
                scores = []
                for j in keys:
                    qi, kj = q[b, i, h], k[b, j, g]
                    if query_scale is not None:
                        qi = qi * query_scale(i)
                    if rotation is not None:
                        a, p = positions(i, j)
                        qi, kj = rotation(a) @ qi, rotation(p) @ kj
                    scores.append(float(qi @ kj) * softmax_scale)
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
    return output_projection(module, out.reshape(batch, length, -1))


def toeplitz_attention(q, k, v, table, q_len: int, scale: float):
    """softmax(q k^T * scale + table[h, i - j], j <= i) v for the first n of q_len queries
    (query i at key position i + Tk - q_len), every tensor written out: q (B, H, n, D), k/v
    (B, H, Tk, D), table (H, >= n + Tk - q_len) -> (B, H, n, D)."""
    n, k_len = q.shape[2], k.shape[2]
    distance = torch.arange(n)[:, None] + (k_len - q_len) - torch.arange(k_len)[None, :]  # (n, Tk)
    bias = table[:, distance.clamp(min=0)].masked_fill(distance < 0, float("-inf"))  # (H, n, Tk)
    weights = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return weights @ v


def assert_as_accurate_as_the_formula(runs: dict[str, tuple], want: tuple, dtype: torch.dtype) -> None:
    """``runs["ours"]`` and ``runs["formula"]``: (output, *gradients) of one computation in
    ``dtype``; ``want``: the same in fp64. Ours is no further from fp64 than twice the written-out
    formula's error in the same dtype, plus 4 eps, for the output and every gradient."""
    errors = {
        name: [(a.double() - b).abs().max().item() for a, b in zip(got, want, strict=True)]
        for name, got in runs.items()
    }
    eps = torch.finfo(dtype).eps
    for ours, formula in zip(errors["ours"], errors["formula"], strict=True):
        assert ours <= 2 * formula + 4 * eps, errors
