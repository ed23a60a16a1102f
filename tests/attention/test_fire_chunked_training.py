"""FIRE through the chunked backend with gradients (issue 21.6): the output and the gradients of
q, k, v and of every FIRE parameter (the MLP's w1, b1, w2, b2, c and the L multiplier) equal
autograd through attention with the bias written from the paper's formula (Li et al. 2023,
arXiv:2310.04418) for every score, in fp64,

    softmax(q k^T s + b) v,   b_h(i, j) = f_h( log(1 + |c| (i - j)) / (log(1 + |c| max(L, p_i)) + 1e-6) ),
    f = W2 relu(W1 x + b1) + b2,   L = |L_multiplier| * init_L,

whatever the length, block size, threshold L (rows below it are the Toeplitz table, rows past it
blocks rebuilt in backward), left padding (positions p restart after the pads) and whichever way
a block is built (the network's matrix products or the linear pieces).

Tolerance: fp32's own. A parameter's gradient is a sum over every score of dS * db/dtheta, and
for c at small c L those terms nearly cancel (psi(i - j) and the normaliser move together), so
beside atol 1e-5 / rtol 1e-4 each gradient may be off by 16 fp32 epsilons of M = sum |dS| |db /
dtheta| (fp64), the size of what is summed, where |dS| is the size of what dS = P (dP - delta) is
made of, P (|dP| + |delta|) (with |dS| itself the eager fp32 formula missed out.weight's gradient
where dP and delta cancel: 15 tokens, c = 1.5, seed 457). The eager fp32 formula is checked
against the same tolerance (without M it was 4.6e-5 off on a c gradient of 0.396: c = 0.075,
17 tokens).
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from hf_posenc.attention.chunked import attend_chunked
from hf_posenc.encodings import network_bands, network_bands_backward, network_block, piecewise_bias
from hf_posenc.encodings.fire import FIREFunction

HEADS, WIDTH_D = 2, 4


def _function(width: int, c: float, threshold: float, generator: torch.Generator) -> FIREFunction:
    """Random weights whose kinks -b1/w1 mostly fall inside [0, 1] (x's range)."""
    function = FIREFunction(HEADS, width, init_c=c, init_L=threshold)
    with torch.no_grad():
        w1 = torch.randn(width, generator=generator) * 3
        function.hidden.weight.copy_(w1[:, None])
        function.hidden.bias.copy_(-w1 * torch.rand(width, generator=generator))
        function.out.weight.copy_(torch.randn(HEADS, width, generator=generator))
        function.out.bias.copy_(torch.randn(HEADS, generator=generator))
        function.L_multiplier.fill_(0.9)
    return function


def _formula_bias(params: dict[str, torch.Tensor], init_l: float, positions: torch.Tensor) -> torch.Tensor:
    """(B, H, T, T) in the parameters' dtype, differentiable in each (``FIREFunction``'s names):
    every score's x through the MLP."""
    c = params["c"].abs()[0]
    # (the normaliser's c as a parameter of its own where given: the two paths of c's gradient apart)
    c_normalizer = params["c_normalizer"].abs()[0] if "c_normalizer" in params else c
    threshold = (params["L_multiplier"][0] * init_l).abs()
    length = positions.shape[1]
    i = torch.arange(length, dtype=c.dtype)
    distance = (i[:, None] - i[None, :]).clamp(min=0)  # (T, T)
    normalizer = torch.log1p(c_normalizer * torch.maximum(positions.to(c.dtype), threshold)) + 1e-6  # (B, T)
    x = torch.log1p(c * distance)[None] / normalizer[:, :, None]  # (B, T, T)
    hidden = torch.relu(
        x[..., None] * params["hidden.weight"][:, 0] + params["hidden.bias"]
    )  # (B, T, T, width)
    bias = hidden @ params["out.weight"].t() + params["out.bias"]  # (B, T, T, H)
    return bias.permute(0, 3, 1, 2)


def _formula_gradients(function, leaves, positions, allowed, scale, weight, dtype):
    """Autograd of sum(softmax(q k^T s + b) v * weight) with the formula's bias, all in ``dtype``:
    (the gradients of q, k, v and of every parameter in name order, fp64; the size of each
    score's gradient, fp64).

    A score's gradient dS = P (dP - delta), delta = sum_j P dP, is a difference: where dP and
    delta nearly cancel, dS is small but its fp32 rounding is not. Its size here is what the
    difference is made of, P (|dP| + |delta|)."""
    function.zero_grad()
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in leaves)
    params = {name: p.to(dtype) for name, p in function.named_parameters()}
    bias = _formula_bias(params, function.init_L, positions)
    scores = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded queries: no key at all
    weights.retain_grad()
    ((weights @ v).transpose(1, 2) * weight.to(dtype)).sum().backward()
    grads = [t.grad.double() for t in (q, k, v)] + [p.grad.double() for p in function.parameters()]
    probability, grad_weights = weights.detach().double(), weights.grad.double()  # (B, H, T, T)
    delta = (probability * grad_weights).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    return grads, probability * (grad_weights.abs() + delta.abs())


def _formula_output(function, leaves, positions, allowed, scale) -> torch.Tensor:
    """softmax(q k^T s + b) v from the formula in fp64: (B, T, H, D)."""
    q, k, v = (t.detach().double() for t in leaves)
    params = {name: p.detach().double() for name, p in function.named_parameters()}
    scores = q @ k.transpose(-1, -2) * scale + _formula_bias(params, function.init_L, positions)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)


def _summed_magnitudes(function, positions, score_sizes) -> list[torch.Tensor]:
    """Per parameter element, M = sum over scores of |dS| |d bias / d theta| (fp64), |dS| as the
    size of what it is computed from (``_formula_gradients``): the size of the terms its gradient
    sums, relative to which fp32 sums are accurate."""
    params = {name: p.detach().double() for name, p in function.named_parameters()}
    # c's gradient is the sum of its paths through psi(i - j) and through the normaliser, which
    # nearly cancel where c L is small: each path's size counts (c = 0.05, L = 1: the net size
    # put the eager fp32 formula's own error past the tolerance)
    paths = {**params, "c_normalizer": params["c"].clone()}
    jacobians = torch.func.jacrev(lambda ps: _formula_bias(ps, function.init_L, positions))(paths)
    jacobians["c"] = jacobians["c"].abs() + jacobians.pop("c_normalizer").abs()
    magnitudes = []
    for name, value in params.items():
        terms = score_sizes[(...,) + (None,) * value.dim()] * jacobians[name].abs()  # (B, H, T, T, *shape)
        magnitudes.append(terms.sum(dim=(0, 1, 2, 3)))
    return magnitudes


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 24),
    block=st.sampled_from([3, 4, 8]),
    threshold=st.floats(1.0, 20.0),
    c=st.floats(0.05, 2.0),
    width=st.integers(1, 12),
    pads=st.one_of(st.none(), st.integers(0, 5)),
    network=st.booleans(),
    chunk=st.sampled_from([1, 40, 16384]),
    bands=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(
    length=15, block=3, threshold=1.0, c=1.5, width=10, pads=0, network=False, chunk=1, bands=False, seed=457
)
@example(
    length=2, block=3, threshold=1.0, c=0.05, width=9, pads=0, network=False, chunk=1, bands=False, seed=1461
)
def test_fire_training_through_chunked_blocks_equals_autograd_of_the_formula(
    length, block, threshold, c, width, pads, network, chunk, bands, seed
):
    generator = torch.Generator().manual_seed(seed)
    function = _function(width, c, threshold, generator)
    # not at max(L, i)'s kink: where L (fp32 or fp64) meets a position, the gradient of L is
    # undefined (torch splits a tie of max between both; fp32 and fp64 round L to either side)
    big_l = float(function.threshold().detach())
    assume(all(abs(big_l - p) > 1e-3 for p in range(length)))
    batch = 1 if pads is None else 2
    q, k, v = (torch.randn(batch, HEADS, length, WIDTH_D, generator=generator) for _ in range(3))
    grad = torch.randn(batch, length, HEADS, WIDTH_D, generator=generator)
    index = torch.arange(length)
    positions = index[None].expand(batch, -1)
    real = torch.ones(batch, length, dtype=torch.bool)  # (B, T) a real token
    mask = None
    if pads is not None:  # the second row left-padded by ``pads``: positions restart after them
        pads = min(pads, length - 1)
        positions = torch.stack((index, (index - pads).clamp(min=0)))
        real[1, :pads] = False
        causal = index[None, :] <= index[:, None]  # (T, T)
        mask = (causal[None] & real[:, None, :])[:, None]  # (B, 1, T, T)
    scale = 0.6

    function.zero_grad()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # every block from the network's products (network) or from the linear pieces
    # or, causal blocks of at least twice as many keys as rows (bands), from bands of distances
    built = []  # whether each block built from the network's products had gradients
    banded = []  # the same for the blocks built in bands
    scratched = []  # whether each banded block with gradients was given a buffer to be written into
    apply, apply_banded = network_block.NetworkBlock.apply, network_bands_backward.BandedBlock.apply
    # banded blocks rebuilt in backward a group of heads at a time (fp32, one row of normalisers)
    rebuilt_heads, rebuilt = [], network_bands_backward.RebuiltHeads

    def counting_rebuilt(*args):
        rebuilt_heads.append(1)
        return rebuilt(*args)

    def counting(*args):
        built.append(torch.is_grad_enabled())
        return apply(*args)

    def counting_banded(*args):
        banded.append(torch.is_grad_enabled())
        if torch.is_grad_enabled():
            scratched.append(args[-1] is not None)
        return apply_banded(*args)

    with (
        mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", 100 if network else 0),
        mock.patch.object(network_block, "NETWORK_CHUNK", chunk),  # scores per slab, both directions
        mock.patch.object(network_bands, "BANDS", bands),
        mock.patch.object(
            piecewise_bias, "FEW_ROWS", 0
        ),  # every block as a long call's (not a few rows' view)
        mock.patch.object(network_block.NetworkBlock, "apply", counting),
        mock.patch.object(network_bands_backward.BandedBlock, "apply", counting_banded),
        mock.patch.object(network_bands_backward, "RebuiltHeads", counting_rebuilt),
    ):
        bias = function.bias(positions, length, length)
        out = attend_chunked(*leaves, bias=bias, mask=mask, softmax_scale=scale, block=block)  # (B, T, H, D)
        weight = grad * real[:, :, None, None]  # padded queries attend nothing: not compared
        (out * weight).sum().backward()
    # blocks written out (not the Toeplitz view of the queries at or below L, which the chunked
    # backend takes for more than 16 queries without a padding mask) take their gradient there
    table_rows = int((index <= float(function.threshold().detach())).sum())
    written = mask is not None or length <= 16 or length > table_rows
    # (banded: the causal blocks without padding whose keys are at least twice their rows)
    # (rebuilt in backward: more than one block; the leading blocks inside the table's rows are
    # its Toeplitz view past 16 queries)
    spans = [(start, min(length, start + block)) for start in range(0, length, block)]
    toeplitz = max((stop for _, stop in spans if stop <= table_rows), default=0) if length > 16 else 0
    bandable = any(stop >= 2 * (stop - start) for start, stop in spans if stop > toeplitz)
    takes_bands = bands and mask is None and len(spans) > 1 and bandable
    assert (True in banded or bool(rebuilt_heads)) == takes_bands, "no block took the banded backward"
    # rebuilt in backward into the forward's bias buffer (one batch row here: no padding)
    assert all(scratched), "a banded block was rebuilt into a new tensor"
    if not takes_bands:
        assert (True in built) == (network and written), "no block took the network's backward"
    got = [t.grad for t in leaves] + [p.grad.clone() for p in function.parameters()]

    allowed = index[None, :] <= index[:, None] if mask is None else mask
    expected, score_sizes = _formula_gradients(
        function, leaves, positions, allowed, scale, weight, torch.float64
    )
    eager32, _ = _formula_gradients(function, leaves, positions, allowed, scale, weight, torch.float32)
    want = _formula_output(function, leaves, positions, allowed, scale)

    rows = real[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    names = ["q", "k", "v"] + [n for n, _ in function.named_parameters()]
    magnitudes = [torch.zeros(())] * 3 + _summed_magnitudes(function, positions, score_sizes)
    epsilon = torch.finfo(torch.float32).eps
    for name, g, e32, e, m in zip(names, got, eager32, expected, magnitudes, strict=True):
        tolerance = 1e-5 + 1e-4 * e.abs() + 16 * epsilon * m
        assert bool(((e32 - e).abs() <= tolerance).all()), (
            f"{name}: the eager fp32 formula misses the tolerance"
        )
        excess = float(((g.double() - e).abs() - tolerance).max())
        assert excess <= 0, f"{name}: {excess:.3g} past the tolerance"


@settings(max_examples=10, deadline=None)
@given(
    length=st.integers(8, 48),
    c=st.floats(0.02, 0.1),
    threshold=st.floats(1.0, 5.0),
    network=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_c_gradient_at_small_c_is_as_accurate_as_its_terms(length, c, threshold, network, seed):
    """Given a block's gradient G, c's gradient sum G f'(x) dx/dc through a folded block (rows past
    L, every key) is within one fp32 epsilon of M = sum |G| |db/dc| of the fp64 formula's: the two
    halves of dx/dc (through psi(i - j) and through the normaliser) nearly cancel at small c, and
    summed apart in fp32 they were 5-8 epsilons of M off."""
    generator = torch.Generator().manual_seed(seed)
    function = _function(8, c, threshold, generator)
    positions = torch.arange(length)[None]
    causal = torch.arange(length)[None, :] <= torch.arange(length)[:, None]  # (T, T)
    grad = torch.randn(1, HEADS, length, length, generator=generator) * causal
    params = {name: p.detach().double().requires_grad_() for name, p in function.named_parameters()}
    (_formula_bias(params, function.init_L, positions) * grad.double()).sum().backward()
    jacobian = torch.func.jacrev(lambda c_: _formula_bias({**params, "c": c_}, function.init_L, positions))(
        params["c"].detach()
    )  # (1, H, T, T, 1)
    magnitude = float((grad.double().abs() * jacobian[..., 0].abs()).sum().detach())
    with mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", 100 if network else 0):
        block = function.bias(positions, length, length).folded(0, length, 0, length, None, torch.float32)
    (torch.where(causal, block, 0.0) * grad).sum().backward()
    error = abs(float(function.c.grad[0]) - float(params["c"].grad[0]))
    assert error <= torch.finfo(torch.float32).eps * magnitude, (error, magnitude)


def test_fire_training_in_fp64_through_either_way_of_building_a_block():
    """fp64 q, k, v through the chunked backend (blocks past L from the network's products or
    from the linear pieces, whose masked pieces once overflowed fp32 with fp64's minimum): the
    output and every gradient equal autograd of the formula in fp64, within fp32's accuracy of
    the bias (its pieces are fp32)."""
    generator = torch.Generator().manual_seed(3)
    function = _function(6, 0.3, 5.0, generator)
    length = 20
    leaves = [
        torch.randn(1, HEADS, length, WIDTH_D, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    ]
    positions = torch.arange(length)[None]
    allowed = torch.arange(length)[None, :] <= torch.arange(length)[:, None]
    weight = torch.randn(1, length, HEADS, WIDTH_D, generator=generator, dtype=torch.float64)
    expected, _ = _formula_gradients(function, leaves, positions, allowed, 0.5, weight, torch.float64)
    want = _formula_output(function, leaves, positions, allowed, 0.5)
    for columns in (100, 0):
        function.zero_grad()
        for leaf in leaves:
            leaf.grad = None
        with mock.patch.object(network_block, "NETWORK_COLUMNS_PER_HEAD", columns):
            bias = function.bias(positions, length, length)
            out = attend_chunked(*leaves, bias=bias, mask=None, softmax_scale=0.5, block=4)
            (out * weight).sum().backward()
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        got = [t.grad for t in leaves] + [p.grad.double() for p in function.parameters()]
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
