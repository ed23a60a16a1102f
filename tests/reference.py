"""Independent references, written from the papers' formulas with loops and explicit
matrices. Nothing here imports hf_posenc: the tests compare the package against these.
"""

from __future__ import annotations

import math

import torch

# -- positional values ------------------------------------------------------------------


def sinusoidal_vector(n: int, d: int, base: float = 10000.0) -> list[float]:
    """Vaswani et al.: P[n, 2i] = sin(n / base^(2i/d)), P[n, 2i+1] = cos(n / base^(2i/d))."""
    out = []
    for k in range(d):
        i = k // 2
        angle = n / base ** (2 * i / d)
        out.append(math.sin(angle) if k % 2 == 0 else math.cos(angle))
    return out


def alibi_slopes(n: int) -> list[float]:
    """Press et al.'s reference ``get_slopes`` (recursive form)."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def t5_bucket(n: int, num_buckets: int, max_distance: int) -> int:
    """Seed 001's bucket(n) for the causal distance n = i - j (future keys: bucket 0)."""
    n = max(n, 0)
    half = num_buckets // 2
    if n < half:
        return n
    if n >= max_distance:
        return num_buckets - 1
    return min(num_buckets - 1, half + math.floor(math.log(n / half) / math.log(max_distance / half) * half))


def expe_values(n: int, l: int, S: float, theta: float, factor: float = 1.0) -> list[float]:  # noqa: E741, N803
    """ExPE eq. 3: (p_n, ..., p_{n+l-1}) with p_m = S + theta*m, position part divided by factor."""
    return [S + theta * (n + j) / factor for j in range(l)]


def exqpe_values(n: int, l: int, S: float, theta1: float, theta2: float, factor: float = 1.0) -> list[float]:  # noqa: E741, N803
    """ExQPE eq. 5 by its recurrence: p_0 = (S+theta2, S+theta1, ..., S+(l-1)theta1); step i adds theta2 to i mod l."""
    p = [S + i * theta1 for i in range(l)]
    p[0] += theta2
    for i in range(1, n + 1):
        p[i % l] += theta2
    return [S + (v - S) / factor for v in p]


def rotation_matrix(
    position: float, inv_freq: list[float], head_dim: int, attention_factor: float = 1.0
) -> torch.Tensor:
    """RoPE's block rotation acting on pairs (i, i + d_rot/2) of the first d_rot dims (Llama layout)."""
    rotary = 2 * len(inv_freq)
    half = rotary // 2
    matrix = torch.eye(head_dim, dtype=torch.float64)
    for i, omega in enumerate(inv_freq):
        c, s = math.cos(position * omega) * attention_factor, math.sin(position * omega) * attention_factor
        matrix[i, i], matrix[i, i + half] = c, -s
        matrix[i + half, i], matrix[i + half, i + half] = s, c
    return matrix


def xpos_matrices(
    position: float,
    inv_freq: list[float],
    head_dim: int,
    *,
    scale_base: float,
    gamma: float,
    decay_position: float,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """xPos (Sun et al. 2023, Sec. 3): (query map, key map) of one token. Pair i of the rotary dims
    is RoPE's rotation by ``position`` times zeta_i^(p/gamma) for queries and zeta_i^(-p/gamma) for
    keys, zeta_i = (i/(d/2) + c)/(1 + c) with c = ``gamma``, gamma = ``scale_base``, p = ``decay_position``."""
    half = len(inv_freq)
    rotation = rotation_matrix(position, inv_freq, head_dim, attention_factor)
    up = torch.ones(head_dim, dtype=torch.float64)
    down = torch.ones(head_dim, dtype=torch.float64)
    for i in range(half):
        zeta = (i / half + gamma) / (1 + gamma)
        for dim in (i, i + half):
            up[dim] = zeta ** (decay_position / scale_base)
            down[dim] = zeta ** (-decay_position / scale_base)
    return torch.diag(up) @ rotation, torch.diag(down) @ rotation


# -- one attention layer ------------------------------------------------------------------


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
    Allowed keys: j <= i, and i - j < window when a sliding window is set.
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
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                scores = []
                for j in keys:
                    key_map = key_rotation or rotation
                    kj = key_map(j, i) @ k[b, j, g] if key_map else k[b, j, g]
                    scores.append(float(qi @ kj) * softmax_scale + (bias(h, i, j) if bias else 0.0))
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
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
) -> torch.Tensor:
    """softmax_j((R(a) q_i) . (R(b) k_j) * softmax_scale) v_j with ``(a, b) = positions(i, j)``: RoPE
    where the rotation of both query and key depends on the pair (SelfExtend, ReRoPE).
    ``rotation(p) -> (D, D)`` is the RoPE matrix of position p (None: no rotation); allowed keys:
    j <= i, and i - j < window when a sliding window is set."""
    hidden = hidden.double()
    batch, length, _ = hidden.shape
    q, k, v = projections(module, hidden, hidden)
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(batch, length, heads, q.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            g = h // (heads // kv_heads)
            for i in range(length):
                keys = [j for j in range(i + 1) if window is None or i - j < window]
                scores = []
                for j in keys:
                    qi, kj = q[b, i, h], k[b, j, g]
                    if rotation is not None:
                        a, p = positions(i, j)
                        qi, kj = rotation(a) @ qi, rotation(p) @ kj
                    scores.append(float(qi @ kj) * softmax_scale)
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[b, i, h] = sum(w * v[b, j, g] for w, j in zip(weights, keys, strict=True))
    return output_projection(module, out.reshape(batch, length, -1))


def kerple_bias(params: dict, posenc, layer_idx: int):
    """KERPLE: log -r1*log(1 + r2*(i-j)), power -r1*(i-j)^r2; r1, r2 >= 0.01, power r2 <= 2."""
    row = 0 if params.get("shared_across_layers", True) else layer_idx
    r1 = [max(float(v), 0.01) for v in posenc.r1[row].detach().double()]
    r2 = [max(float(v), 0.01) for v in posenc.r2[row].detach().double()]
    if params.get("variant", "log") == "power":
        r2 = [min(v, 2.0) for v in r2]
        return lambda h, i, j: -r1[h] * (i - j) ** r2[h]
    return lambda h, i, j: -r1[h] * math.log(1 + r2[h] * (i - j))


def sandwich_bias(params: dict, heads: int):
    """Sandwich: (sum_{k=1}^{d'/2} cos((i-j)/10000^(2k/d')) - d'/2) / (8h/H), h = 1..H."""
    dim = params.get("dim", 128)

    def bias(h, i, j):
        kernel = sum(math.cos((i - j) / 10000 ** (2 * k / dim)) for k in range(1, dim // 2 + 1))
        return (kernel - dim / 2) / (8 * (h + 1) / heads)

    return bias


def fire_bias(params: dict, posenc, layer_idx: int):
    """FIRE: f(log(1+|c|(i-j)) / (log(1+|c| max(L, i)) + 1e-6)), f = W2 relu(W1 x + b1) + b2."""
    index = layer_idx if not params.get("shared_across_layers", False) else 0
    fn = posenc.functions[index]
    c = abs(float(fn.c.detach()))
    big_l = abs(float(fn.L_multiplier.detach()) * params.get("init_L", 512.0))
    w1, b1 = fn.hidden.weight.detach().double()[:, 0].tolist(), fn.hidden.bias.detach().double().tolist()
    w2, b2 = fn.out.weight.detach().double().tolist(), fn.out.bias.detach().double().tolist()
    cache = {}

    def bias(h, i, j):
        if (h, i, j) not in cache:
            x = math.log(1 + c * (i - j)) / (math.log(1 + c * max(big_l, i)) + 1e-6)
            hidden = [max(0.0, w * x + b) for w, b in zip(w1, b1, strict=True)]
            cache[h, i, j] = sum(w * a for w, a in zip(w2[h], hidden, strict=True)) + b2[h]
        return cache[h, i, j]

    return bias
