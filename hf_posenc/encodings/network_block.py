"""One chunked block of FIRE's bias from its one-input ReLU network as matrix products (Li et
al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers",
arXiv:2310.04418, whose f_theta is such a network), forward and backward, on CPU:

    bias[b, h, a, j] = f_h(x[b, a, j]),   f_h(x) = w2[h] @ relu(w1 x + b1) + b2[h]

Over a block's range of x, [min x, max x], a unit whose pre-activation w1_k x + b1_k has one
sign at both ends is linear there (on: folded into a constant and an x column) or zero (off);
only the K' units that switch inside the range are features, so the block is

    bias_h = W[h] @ F,   W = (b2 + w2 b1_on, w2 w1_on, w2[:, switching])   (Hq, 2 + K')
                         F = (1, x, relu(u_k x + o_k) for the switching units)   (2 + K', scores)

for all heads at once, one product per slab of rows (the slab's features stay in cache). The
unit rows of F are a product too, ``relu((o, u) @ (1, x))``: a broadcast multiply-add over
(K', scores) measured about 4x slower per value on CPU than that (K', 2) x (2, scores) product.

Backward (:class:`NetworkBlock`), from the block's gradient dS (B', Hq, rows, keys), with F
recomputed per slab: dW = dS F^T (Hq, 2 + K'); the switching units' gradient
G = W[:, 2:]^T dS masked where the unit is off (K', scores) gives (do, du) = G (1, x)^T; and
dx = W[:, 1]^T dS + u^T G. All products over the block's scores, no per-score loop over heads
or units, no cumulative sums; W and (o, u) are built from the network's parameters by autograd
(:func:`network_columns`), so their gradients reach w1, b1, w2, b2. The backward runs over
slabs of whole rows, dS read in place (a (Hq, scores) view of the block's gradient, no copy),
each slab's features and G in two buffers that stay in cache; the causal future is zeroed only
when it holds a nonzero gradient (attention's dS is 0 there). Before, it ran in tiles of 256
keys, each with the units switching inside its own x range as features and dS and x copied
into tile buffers: measured (one layer at T=2048, one thread, under load) about the same time
with tiles of 256 to 1024 keys, the copies and the Python per tile being most of it.
"""

from __future__ import annotations

import functools

import torch

#: scores of a block per matrix product: the slab's features (2 + K' rows, 1.5 MiB at K' = 10) stay
#: in the 2 MiB of L2 per core, and each product is one parallel region of the intra-op threads.
#: ``scripts/cpu_constant_ab.py --encoding fire`` (idle, torch's two threads, 2026-11-26): forward
#: at T=4096 median 0.835 s with 16384, 0.796 s with 32768 (10 alternating rounds; 49152 as 32768,
#: 8192 about 20 % slower than 16384); training at T=2048 1.190 -> 1.154 s (4 rounds)
NETWORK_CHUNK = 32768
#: a block is served from the network when its K' switching units satisfy K' + 2 <= this * Hq
NETWORK_COLUMNS_PER_HEAD = 3

Network = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def network_columns(
    low: torch.Tensor, high: torch.Tensor, network: Network
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W (Hq, 2 + K'), units (K', 2) = (o_k, u_k)) of the block whose x lies in [low, high]
    (0-dim), differentiable in the network's (w1 (K,), b1 (K,), w2 (Hq, K), b2 (Hq,)); None
    when the block has too many switching units (K' + 2 > NETWORK_COLUMNS_PER_HEAD * Hq)."""
    w1, b1, w2, b2 = network
    heads = w2.shape[0]
    with torch.no_grad():
        at_low, at_high = w1 * low + b1, w1 * high + b1  # (K,) pre-activations at the range's ends
        on = (at_low >= 0) & (at_high >= 0)
        switching = ((at_low > 0) | (at_high > 0)) & ~on
        active = switching.nonzero()[:, 0]  # (K',)
    if active.numel() + 2 > NETWORK_COLUMNS_PER_HEAD * heads:
        return None
    constant = b2 + w2 @ torch.where(on, b1, 0.0)  # (Hq,)
    linear = w2 @ torch.where(on, w1, 0.0)  # (Hq,)
    weights = torch.cat((constant[:, None], linear[:, None], w2[:, active]), dim=1)  # (Hq, 2 + K')
    units = torch.stack((b1[active], w1[active]), dim=1)  # (K', 2)
    return weights, units


def network_block(
    x: torch.Tensor,
    network: Network,
    allowed: torch.Tensor | None,
    scratch: torch.Tensor | None,
    x_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    reverse: bool = False,
) -> torch.Tensor | None:
    """x (B|1, rows, keys) -> (B', Hq, rows, keys) fp32, the masked keys (``allowed`` (B|1, 1,
    rows, keys) False, or None: the future of each row, bottom-right aligned; with ``reverse``
    the keys are in reverse order, the future first) at the dtype's minimum; None when the
    linear pieces are cheaper. ``scratch``: a flat fp32 buffer the block may be written into
    (only without gradients); ``x_range``: (low, high) containing every x (default: its min/max)."""
    with torch.no_grad():
        low, high = torch.aminmax(x) if x_range is None else x_range
    columns = network_columns(low, high, network)
    if columns is None:
        return None
    weights, units = columns
    batch = x.shape[0] if allowed is None else max(x.shape[0], allowed.shape[0])
    out = None
    if not torch.is_grad_enabled() and scratch is not None and scratch.dtype == x.dtype:
        size = batch * weights.shape[0] * x.shape[1] * x.shape[2]
        if scratch.numel() >= size:
            out = scratch[:size].view(batch, weights.shape[0], *x.shape[1:])
    return NetworkBlock.apply(x, weights, units, allowed, batch, out, reverse)


def reversed_network_block(
    feature: torch.Tensor,
    normalizer: torch.Tensor,
    first: int,
    keys: int,
    network: Network,
    x_range: tuple[torch.Tensor, torch.Tensor],
    scratch: torch.Tensor | None,
) -> torch.Tensor | None:
    """The causal block over keys in reverse order, without gradients, x computed slab by slab
    into the features it feeds: x[b, a, j'] = feature[max(0, first + a + j')] / normalizer[b, a]
    (reversed key j' = the block's key keys-1-j'; feature (Tk,) and normalizer (B|1, rows) in
    any float dtype, the quotient rounded once to fp32, as :class:`NetworkBlock`'s x) ->
    (B|1, Hq, rows, keys) fp32, the future (the first keys of each row but the last) at the
    dtype's minimum; None when the linear pieces are cheaper (too many switching units).

    Each slab of rows is three passes over cache-resident features (the quotient, the switching
    units' product and clamp) and one product writing the block, instead of a (B, rows, keys) x
    written out, copied into the features and read again."""
    columns = network_columns(x_range[0], x_range[1], network)
    if columns is None:
        return None
    weights, units = columns
    batch, rows = normalizer.shape
    heads, device = weights.shape[0], feature.device
    size = batch * heads * rows * keys
    if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= size:
        out = scratch[:size].view(batch, heads, rows, keys)
    else:
        out = torch.empty(batch, heads, rows, keys, dtype=torch.float32, device=device)
    positions = torch.arange(first, first + rows + keys - 1, device=device).clamp_(min=0)
    # x in fp32 as line * (1 / normaliser): a product per score instead of an fp64 quotient
    # (within ~2 ulp of the quotient)
    line = feature[positions].float()  # (rows + keys - 1,)
    inverse = normalizer.reciprocal()[:, :, None].float()  # (B|1, rows, 1)
    slab = max(1, NETWORK_CHUNK // keys)  # rows per product
    full = min(slab, rows)
    features = torch.empty(weights.shape[1], full * keys, dtype=torch.float32, device=device)
    features[0] = 1.0
    flat = out.view(batch, heads, rows * keys)
    for b in range(batch):
        for start in range(0, rows, slab):
            count = min(rows, start + slab) - start
            # the slab's views of the features (the last slab may be shorter)
            chunk = features[:, : count * keys]
            source = line.as_strided((count, keys), (1, 1), line.storage_offset() + start)
            torch.mul(source, inverse[b, start : start + count], out=chunk[1].view(count, keys))
            if units.shape[0]:
                hidden = chunk[2:]
                torch.mm(units, chunk[:2], out=hidden)
                hidden.clamp_(min=0)
            torch.mm(weights, chunk, out=flat[b, :, start * keys : (start + count) * keys])
    # the future (the first keys of each row but the last): the dtype's minimum added, one pass per
    # block (bias + minimum rounds to the minimum for |bias| < 2^103; measured ~2x faster than a
    # masked_fill_ broadcast over the heads)
    span = min(rows, keys)
    out[..., :span].add_(future_minimum(rows, span, device))
    return out


@functools.lru_cache(maxsize=8)
def future_minimum(rows: int, span: int, device: torch.device) -> torch.Tensor:
    """(rows, span) fp32: the dtype's minimum where reversed key j' < span - rows + (rows - 1 - a)
    is a future key of row a (the first keys of a causal block over keys in reverse order), 0
    elsewhere; cached (the chunked backend's blocks share a few shapes)."""
    _, future = _future(rows, span, device, reverse=True)
    return torch.zeros(rows, span, device=device).masked_fill_(future, torch.finfo(torch.float32).min)


def _future(rows: int, keys: int, device: torch.device, reverse: bool) -> tuple[slice, torch.Tensor]:
    """The causal mask of a block bottom-right aligned: (the last ``span`` keys, or with
    ``reverse`` (keys in reverse order) the first, and (rows, span) bool True where query a may
    not attend there)."""
    span = min(rows, keys)
    future = torch.ones(rows, span, dtype=torch.bool, device=device).triu_(1 + span - rows)
    if reverse:
        return slice(0, span), future.flip(-1)
    return slice(keys - span, keys), future


def _features(features: torch.Tensor, values: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Fill ``features`` (2 + K', >= n) with (1, x, relu(o + u x)) of ``values`` (1, n); -> the
    (2 + K', n) view. Row 0 holds ones already."""
    chunk = features[:, : values.shape[1]]
    chunk[1:2].copy_(values)
    if units.shape[0]:
        torch.mm(units, chunk[:2], out=chunk[2:]).clamp_(min=0)
    return chunk


class NetworkBlock(torch.autograd.Function):
    """(x (B|1, rows, keys), W (Hq, 2 + K'), units (K', 2), allowed, batch B', out or None) ->
    the block W @ (1, x, relu(units @ (1, x))) (B', Hq, rows, keys) with the mask folded in;
    masked entries pass no gradient. See the module's docstring for both directions."""

    @staticmethod
    def forward(ctx, x, weights, units, allowed, batch, out, reverse=False):
        heads, (_, rows, keys) = weights.shape[0], x.shape
        if out is None:
            out = x.new_empty(batch, heads, rows, keys)
        slab = max(1, NETWORK_CHUNK // keys)  # rows per product
        features = x.new_empty(weights.shape[1], min(slab, rows) * keys)
        features[0] = 1.0  # (a product, not addmm: addmm first copies its broadcast input into the output)
        minimum = torch.finfo(x.dtype).min
        tail, future = _future(rows, keys, x.device, reverse)
        for b in range(x.shape[0]):
            for first in range(0, rows, slab):
                last = min(rows, first + slab)
                chunk = _features(features, x[b, first:last].reshape(1, -1), units)
                block = out[b, :, first:last]  # (Hq, slab, keys)
                torch.mm(weights, chunk, out=block.view(heads, -1))
                if allowed is None:  # the future keys, while the slab is in cache
                    block[..., tail].masked_fill_(future[first:last], minimum)
        if x.shape[0] < batch:  # rows of their own only in the mask
            out[1:].copy_(out[:1].expand(batch - 1, -1, -1, -1))
        if allowed is not None:
            out.masked_fill_(~allowed, minimum)
        ctx.save_for_backward(x, weights, units, allowed)
        ctx.reverse = reverse
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weights, units, allowed = ctx.saved_tensors
        (_, rows, keys), heads, count = x.shape, weights.shape[0], units.shape[0]
        grad = _attendable_gradient(grad.float(), allowed, rows, keys, ctx.reverse)
        if grad.shape[0] > x.shape[0]:  # one x for every batch row
            grad = grad.sum(dim=0, keepdim=True)
        grad = grad.contiguous()
        grad_weights, grad_units = torch.zeros_like(weights), torch.zeros_like(units)
        grad_x = torch.empty_like(x)
        slab = max(1, NETWORK_CHUNK // keys) * keys  # scores per product: whole rows
        size = min(slab, rows * keys)
        features = x.new_empty(2 + count, size)  # (1, x, relu(o + u x)) of one slab
        features[0] = 1.0
        hidden_grad = x.new_empty(count, size)
        linear = weights[:, 1:2].t()  # (1, Hq): dS's weight in dx through the x column
        unit_out = weights[:, 2:].t()  # (K', Hq)
        slopes = units[:, 1:2].t()  # (1, K') u
        for b in range(x.shape[0]):
            flat_grad = grad[b].view(heads, rows * keys)  # (Hq, rows * keys) dS
            flat_x, flat_dx = x[b].reshape(rows * keys), grad_x[b].view(rows * keys)
            for start in range(0, rows * keys, slab):
                stop = min(rows * keys, start + slab)
                chunk = features[:, : stop - start]
                chunk[1].copy_(flat_x[start:stop])
                scores = flat_grad[:, start:stop]  # (Hq, n) a view of dS
                line = flat_dx[start:stop].view(1, -1)
                torch.mm(linear, scores, out=line)
                if count:
                    torch.mm(units, chunk[:2], out=chunk[2:]).clamp_(min=0)
                    hidden = hidden_grad[:, : stop - start]  # dL/d relu(.), zero where the unit is off
                    torch.mm(unit_out, scores, out=hidden)
                    torch.ops.aten.threshold_backward.grad_input(hidden, chunk[2:], 0.0, grad_input=hidden)
                    grad_units.addmm_(hidden, chunk[:2].t())
                    line.addmm_(slopes, hidden)
                grad_weights.addmm_(scores, chunk.t())
        return grad_x, grad_weights, grad_units, None, None, None, None


def _attendable_gradient(
    grad: torch.Tensor, allowed: torch.Tensor | None, rows: int, keys: int, reverse: bool
) -> torch.Tensor:
    """The block's gradient (B', Hq, rows, keys) with the masked entries at 0 (they pass none): a
    new tensor where ``allowed`` is given or the causal future holds a nonzero value, else
    ``grad`` itself (attention's dS is 0 there already: its weights are)."""
    if allowed is not None:
        return grad.masked_fill(~allowed, 0.0)
    tail, future = _future(rows, keys, grad.device, reverse)
    if not bool((grad[..., tail] != 0).logical_and_(future).any()):
        return grad
    grad = grad.clone()
    grad[..., tail].masked_fill_(future, 0.0)
    return grad
