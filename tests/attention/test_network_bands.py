"""FIRE's causal blocks built in bands of distances (:mod:`hf_posenc.encodings.network_bands`):
for blocks of up to 140 rows (the chunked backend builds 128 at a time) over any number of
keys past twice that, networks whose units are linear, off or switching anywhere in [0, 1]
(some with w1 = 0, some with their breakpoint outside the block's x), and batch rows with
their own normalisers, every attendable score is FIRE's formula (Li et al. 2023,
arXiv:2310.04418) written here in fp64,

    b_h(i, j) = f_h( log(1 + c (i - j)) / (log(1 + c max(L, i)) + 1e-6) ),
    f = W2 relu(W1 x + b1) + b2,

and every future key is fp32's minimum; a patched model's logits equal backend="eager"'s."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from hf_posenc.attention import chunked, rebuilt_flash
from hf_posenc.encodings import network_bands, network_bands_backward
from hf_posenc.encodings.fire import FIREFunction
from hf_posenc.encodings.piecewise_bias import PiecewiseDistanceBias

HEADS = 3


def _network(heads: int, width: int, seed: int) -> FIREFunction:
    """A FIRE MLP with random weights: breakpoints -b1/w1 mostly in [0, 1], a few outside, one
    in five units with w1 = 0 (relu(b1), on or off everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    function = FIREFunction(heads, width, init_c=0.1, init_L=512.0)
    with torch.no_grad():
        w1 = torch.randn(width, generator=generator) * 3
        w1[torch.rand(width, generator=generator) < 0.2] = 0.0
        where = torch.rand(width, generator=generator) * 1.4 - 0.2  # breakpoints in [-0.2, 1.2]
        function.hidden.weight.copy_(w1[:, None])
        function.hidden.bias.copy_(-w1 * where + 0.3 * torch.randn(width, generator=generator))
        function.out.weight.copy_(torch.randn(heads, width, generator=generator))
        function.out.bias.copy_(torch.randn(heads, generator=generator))
    return function


@contextlib.contextmanager
def _counted(owner, name: str):
    """Count the calls of ``owner.name`` inside the block: yields the list a call appends to."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counting(*args):
        calls.append(1)
        return original(*args)

    with mock.patch.object(owner, name, counting):
        yield calls


def _normalized_distance(function: FIREFunction, positions: torch.Tensor, keys: int) -> torch.Tensor:
    """fp64 x (B, rows, keys) = log(1 + c (i - j)) / (log(1 + c max(L, p_i)) + 1e-6) of the last
    ``rows`` queries (positions (B, rows)), differentiable in c and the L multiplier."""
    c = function.c.double().abs()[0]
    threshold = function.L_multiplier.double().abs()[0] * function.init_L
    rows = positions.shape[1]
    i = torch.arange(keys - rows, keys, dtype=torch.float64)[:, None]  # (rows, 1) key index of each query
    distance = (i - torch.arange(keys, dtype=torch.float64)).clamp(min=0)  # (rows, keys)
    normalizer = torch.log1p(c * torch.maximum(positions.double(), threshold)) + 1e-6  # (B, rows)
    return torch.log1p(c * distance) / normalizer[:, :, None]


def _formula(function: FIREFunction, positions: torch.Tensor, keys: int) -> torch.Tensor:
    """fp64 (B, H, rows, keys) bias of the last ``rows`` queries over keys 0 .. keys-1 from the
    paper's formula: distances between key indices, the normaliser from the queries' positions
    (B, rows) (future keys: distance 0, not compared); differentiable in every parameter, c =
    |c| and L = |L_multiplier| * init_L."""
    w1 = function.hidden.weight.double()[:, 0]
    b1 = function.hidden.bias.double()
    w2 = function.out.weight.double()
    b2 = function.out.bias.double()
    x = _normalized_distance(function, positions, keys)  # (B, rows, keys)
    hidden = torch.relu(x[..., None] * w1 + b1)  # (B, rows, keys, K)
    return (hidden @ w2.t() + b2).permute(0, 3, 1, 2)


#: a block of ``rows`` queries (the last at key index keys - 1, keys = 2 rows + past), a network
#: of ``width`` units, c and L, one batch row or two with their own normalisers
CASES = {
    "rows": st.integers(1, 140),
    "past": st.integers(0, 300),
    "width": st.integers(1, 40),
    "c": st.floats(0.02, 2.0),
    "threshold": st.floats(1.0, 400.0),
    "second_row": st.booleans(),
    "seed": st.integers(0, 2**16),
}


def _case(rows, past, width, c, threshold, second_row, seed):
    """-> (FIRE function with c and L set, query positions (B, rows), keys, first query's key)."""
    function = _network(HEADS, width, seed)
    with torch.no_grad():
        function.c.fill_(c)
        function.L_multiplier.fill_(threshold / function.init_L)
    keys = 2 * rows + past
    start = keys - rows
    queries = torch.arange(start, keys)[None]  # (1, rows) positions
    if second_row:  # a batch row whose queries' positions are 5 further (its own normalisers)
        queries = torch.cat((queries, queries + 5))
    return function, queries, keys, start


@settings(max_examples=25, deadline=None)
@given(**CASES)
def test_banded_blocks_are_the_formula(rows, past, width, c, threshold, second_row, seed):
    """A block of ``rows`` queries, the last at key index keys - 1, keys = 2 rows + past: built in
    bands (checked: :func:`plan_bands` ran), flipped back from reversed keys it is the formula at
    every causal key (fp32, 1e-5 of the scale) and the minimum at every future one."""
    function, queries, keys, start = _case(rows, past, width, c, threshold, second_row, seed)
    bias = function.bias(queries, rows, keys)
    with torch.no_grad(), _counted(network_bands, "plan_bands") as calls:
        block = bias.folded_reversed(0, rows, keys, torch.float32)
    assert block is not None and len(calls) == queries.shape[0]
    block = block.flip(-1)  # (B, H, rows, keys) over keys 0 .. keys-1
    expected = _formula(function, queries, keys).detach()
    causal = (torch.arange(keys)[None, :] <= torch.arange(start, keys)[:, None]).expand_as(block)
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(block[causal].double(), expected[causal], atol=1e-5 * scale, rtol=1e-5)
    assert bool((block[~causal] == torch.finfo(torch.float32).min).all())


@settings(max_examples=20, deadline=None)
@given(**CASES, group=st.integers(1, HEADS + 1))
def test_banded_head_groups_are_the_formula(rows, past, width, c, threshold, second_row, seed, group):
    """The same block built ``group`` heads at a time (``folded_reversed_heads``, as the chunked
    backend attends FIRE past L without gradients), each group written into one shared buffer:
    consecutive slices of at most ``group`` heads covering every head once, each group's block,
    read before the next one is built, the formula at every causal key of its heads and the
    minimum at every future one."""
    function, queries, keys, start = _case(rows, past, width, c, threshold, second_row, seed)
    bias = function.bias(queries, rows, keys)
    expected = _formula(function, queries, keys).detach()  # (B, H, rows, keys)
    causal = torch.arange(keys)[None, :] <= torch.arange(start, keys)[:, None]  # (rows, keys)
    scale = max(1.0, float(expected.abs().max()))
    scratch = torch.empty(queries.shape[0] * group * rows * keys)
    covered = []
    with torch.no_grad():
        groups = bias.folded_reversed_heads(0, rows, keys, torch.float32, group, scratch)
        assert groups is not None
        for heads, block in groups:
            assert block.data_ptr() == scratch.data_ptr()  # the buffer, not a new block
            assert heads.stop - heads.start == block.shape[1] <= group
            covered.extend(range(heads.start, heads.stop))
            block = block.flip(-1)  # over keys 0 .. keys-1
            want = expected[:, heads]
            torch.testing.assert_close(
                block[..., causal].double(), want[..., causal], atol=1e-5 * scale, rtol=1e-5
            )
            assert bool((block[..., ~causal] == torch.finfo(torch.float32).min).all())
    assert covered == list(range(HEADS))


@pytest.mark.parametrize("heads_at_once", [1, 3, 4])
def test_fire_logits_with_banded_blocks_equal_eager(heads_at_once):
    """T=700 with L=64 and a trained-like network (non-zero output layer, units switching
    inside [0, 1]): the chunked backend's blocks past L come from bands of distances (blocks of
    128 queries over 2 x 128 keys or more), attended ``heads_at_once`` of the 4 query heads at a
    time (3: a group of 3 and one of 1), and its logits equal eager's (fp32, 1e-5), its bias
    buffer never asked for more than one group's block; the same with the bands switched off
    (the network's products)."""
    models = {
        b: patch(make_model("llama"), "fire", {"init_L": 64.0}, backend=b) for b in ("eager", "chunked")
    }
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in models["eager"].posenc.named_parameters():
            if name.endswith(("out.weight", "out.bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    models["chunked"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    ids = token_ids(1, 700)
    # blocks of BUILT_BLOCK = 128 queries (no buffer budget to take more)
    with torch.no_grad(), mock.patch.object(chunked, "BUILT_VALUES", 0):
        reference = models["eager"](ids).logits
        with (
            _counted(network_bands, "plan_bands") as calls,
            mock.patch.object(chunked, "BUILT_HEADS", heads_at_once),
        ):
            banded = models["chunked"](ids).logits
        with mock.patch.object(network_bands, "BANDS", False):
            products = models["chunked"](ids).logits
    layers = models["chunked"].config.num_hidden_layers
    assert len(calls) == layers * 5  # queries 128.., 256.., 384.., 512.., 640..699
    torch.testing.assert_close(banded, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(products, reference, atol=1e-5, rtol=0)


def test_fire_forward_buffer_holds_one_head():
    """Without gradients, past L = 128 every block of 128 queries is built in bands (keys >= 2 x
    128) one query head at a time (``chunked.BUILT_HEADS = 1``): the bias buffer the chunked
    backend asks for holds one head's block (128 x 700 values), a quarter of the 4 heads' block
    it held before."""
    model = patch(make_model("llama"), "fire", {"init_L": 128.0}, backend="chunked")
    with torch.no_grad():  # L = 128: the first 128 queries are a table over distances
        for name, parameter in model.posenc.named_parameters():
            if name.endswith("L_multiplier"):
                parameter.fill_(1.0)
    sizes: list[int] = []
    buffer = chunked.bias_scratch

    def sized(memo, size, *args):
        sizes.append(size)
        return buffer(memo, size, *args)

    with (
        torch.no_grad(),
        mock.patch.object(chunked, "BUILT_VALUES", 0),
        mock.patch.object(chunked, "BUILT_HEADS", 1),
        mock.patch.object(chunked, "bias_scratch", sized),
        _counted(network_bands, "plan_bands") as calls,
    ):
        model(token_ids(1, 700))
    assert len(calls) == model.config.num_hidden_layers * 5  # queries 128.. to 640..699
    assert set(sizes) == {128 * 700}


@settings(max_examples=12, deadline=None)
@given(**CASES, group=st.integers(1, HEADS))
# c's two paths (through psi(d) and through the normaliser) nearly cancel here: with the fp32
# near and inv in dx's sums c's gradient read 3.996e-6 against 4.143e-6
@example(rows=1, past=1, width=1, c=1.0, threshold=1.0, second_row=False, seed=0, group=1)
# two batch rows whose parts of w1's gradient (127 and -126) cancel: fp32's rounding of each shows
@example(rows=127, past=170, width=3, c=0.703125, threshold=1.0, second_row=True, seed=3132, group=1)
def test_banded_block_gradients_are_the_formula_gradients(
    rows, past, width, c, threshold, second_row, seed, group
):
    """The block rebuilt with gradients (``folded_reversed_with_gradients``, as backward of the
    chunked backend's training blocks takes it), and for one row of normalisers rebuilt ``group``
    heads at a time with its gradients added by hand (``rebuilt_reversed_heads``: the same values,
    then each group's dS), under a random upstream gradient (random at the
    future keys too, whose entries are a constant and take no gradient): the gradients of w1, b1, w2, b2, c and the L multiplier are those of the fp64 formula
    (autograd) within 1e-4 of the largest of each, and for c and L within 16 fp32 epsilons of M =
    sum |upstream| |d bias / d theta| (their sums cancel: the terms through psi(i - j) and
    through the normaliser nearly balance); L sits inside the block's rows or below them, not
    on a position (max(L, p)'s kink, where the gradient of L is undefined), and no score within
    rounding of a unit's ReLU kink takes a gradient (its derivative is undefined there)."""
    function, queries, keys, start = _case(rows, past, width, c, threshold, second_row, seed)
    big_l = float(function.threshold().detach())
    assume(all(abs(big_l - float(p)) > 1e-3 for p in queries.reshape(-1)))
    causal = torch.arange(keys)[None, :] <= torch.arange(start, keys)[:, None]  # (rows, keys)
    generator = torch.Generator().manual_seed(seed)
    # random at the future keys too: their entries are the constant minimum, whatever the parameters
    anywhere = torch.randn(queries.shape[0], HEADS, rows, keys, generator=generator).double()
    upstream = anywhere * causal
    # no upstream gradient at a score within rounding of a unit's kink (fp64 |w1 x + b1| < 1e-5):
    # there the ReLU's derivative is 0 or 1 by which side fp32 lands on, a whole term either way
    with torch.no_grad():
        x = _normalized_distance(function, queries, keys)  # (B, rows, keys)
        w1, b1 = function.hidden.weight.double()[:, 0], function.hidden.bias.double()
        kinks = ((x[..., None] * w1 + b1).abs() < 1e-5).any(-1)  # (B, rows, keys)
    upstream = upstream.masked_fill(kinks[:, None], 0.0)
    anywhere = torch.where(causal, upstream, anywhere)
    names, parameters = zip(*function.named_parameters(), strict=True)
    expected = torch.autograd.grad((_formula(function, queries, keys) * upstream).sum(), parameters)
    block = function.bias(queries, rows, keys).folded_reversed_with_gradients(0, rows, keys, torch.float32)
    assert block is not None
    found = torch.autograd.grad((block.flip(-1).double() * anywhere).sum(), parameters, allow_unused=True)
    # the same block rebuilt a group of heads at a time (one row of normalisers: not a second row),
    # its dS given per group and its gradients added by hand (made before the check below moves c
    # and L by central differences)
    form = function.bias(queries, rows, keys)
    rebuilt = form.rebuilt_reversed_heads(0, rows, keys, torch.float32)
    assert (rebuilt is None) == (queries.shape[0] > 1)
    _assert_formula_gradients(function, queries, keys, upstream, names, parameters, expected, found)
    if rebuilt is not None:
        grad_block = anywhere.flip(-1).float()  # (1, H, rows, keys) over reversed keys
        for heads, part in rebuilt.blocks(group, None):
            torch.testing.assert_close(part, block[:, heads].detach(), atol=0, rtol=0)  # the same values
            rebuilt.add_gradient(heads, grad_block[:, heads].clone())
        tensors = list(form.tensors().values())
        pairs = [(t, g) for t, g in zip(tensors, rebuilt.gradients(), strict=True) if g is not None]
        found = torch.autograd.grad(
            [t for t, _ in pairs], parameters, [g for _, g in pairs], allow_unused=True
        )
        _assert_formula_gradients(function, queries, keys, upstream, names, parameters, expected, found)


def _assert_formula_gradients(function, queries, keys, upstream, names, parameters, expected, found):
    """``found`` (None: 0) equal ``expected``, the formula's, within 1e-4 of the largest of each or
    1e-5 of the largest sum over batch rows of each row's part (each row's block is computed on
    its own in fp32: two rows' parts of 127 and -126 summed to -1.48 read 2.5e-4 off, 2e-6 of
    a part), and for c and L within 16 fp32 epsilons of M = sum |upstream| |d bias / d theta|."""
    bias = _formula(function, queries, keys)
    parts = [
        torch.autograd.grad((bias[row] * upstream[row]).sum(), parameters, retain_graph=True)
        for row in range(queries.shape[0])
    ]  # each batch row's gradients
    for index, (name, parameter, want, got) in enumerate(
        zip(names, parameters, expected, found, strict=True)
    ):
        got = torch.zeros_like(want) if got is None else got
        rows_sum = sum(part[index].abs() for part in parts)
        tolerance = max(1e-4 * max(float(want.abs().max()), 1e-3), 1e-5 * float(rows_sum.max()))
        if name in ("c", "L_multiplier"):  # M by central differences of the formula (fp64)
            step = 1e-6 * max(abs(float(parameter.detach())), 1e-3)
            with torch.no_grad():
                parameter += step
                above = _formula(function, queries, keys)
                parameter -= 2 * step
                below = _formula(function, queries, keys)
                parameter += step
            magnitude = float((upstream.abs() * ((above - below) / (2 * step)).abs()).sum())
            tolerance = max(tolerance, 16 * torch.finfo(torch.float32).eps * magnitude)
        torch.testing.assert_close(
            got.double(), want.double(), atol=tolerance, rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


#: how backward rebuilds the banded blocks: a group of heads at a time without a graph
#: (``RebuiltHeads``, rebuilt_flash.REBUILT_HEADS heads), or every head through ``BandedBlock``
REBUILDS = [("heads", 1), ("heads", 3), ("heads", 8), ("block", 4), ("block", 3)]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("rebuild", "group"), REBUILDS, ids=[f"{r}-{g}" for r, g in REBUILDS])
def test_fire_training_with_banded_blocks_equals_eager(rebuild, group, batch):
    """A training step at T=600 with L=32 (blocks of 256 queries with gradients; those of queries
    256.. and 512..599 from bands of distances, forward and backward), rebuilt in backward a group
    of heads at a time (1, 3 of the model's 4, all) or every head through autograd (its chain
    then over groups of all 4 heads or of 3 and 1), a batch of
    one and of two (whose rows share the bias: dS summed over them): the loss and every
    parameter's gradient, the model's and FIRE's own, equal backend="eager"'s (fp32, 1e-5
    absolute and relative, 1e-4 for the gradients of FIRE's c and L, whose sums cancel)."""
    ids = token_ids(batch, 600)
    results = {}
    # mock's patchers may be entered again (once per backend below)
    patchers = [mock.patch.object(rebuilt_flash, "REBUILT_HEADS", group)]
    if rebuild == "heads":
        counted = (network_bands_backward, "RebuiltHeads")
    else:
        counted = (network_bands_backward.BandedBlock, "apply")
        patchers.append(
            mock.patch.object(PiecewiseDistanceBias, "rebuilt_reversed_heads", lambda *args: None)
        )
    for backend in ("eager", "chunked"):
        model = patch(make_model("llama"), "fire", {"init_L": 32.0}, backend=backend)
        model.train()
        # calls: the chunked run's (the last)
        with contextlib.ExitStack() as stack, _counted(*counted) as calls:
            for patcher in patchers:
                stack.enter_context(patcher)
            loss = model(ids, labels=ids).loss
            loss.backward()
        results[backend] = (
            loss.detach(),
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        )
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * 2  # queries 256.. and 512..599, rebuilt in backward
    torch.testing.assert_close(results["chunked"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    chunked_grads, eager_grads = results["chunked"][1], results["eager"][1]
    assert chunked_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        tolerance = 1e-4 if name.endswith((".c", ".L_multiplier")) else 1e-5
        torch.testing.assert_close(chunked_grads[name], grad, atol=tolerance, rtol=tolerance, msg=name)


def test_training_reuses_the_forward_band_plan_in_backward():
    """A training step's banded blocks are planned once, in forward: their rebuild in backward
    (``RebuiltHeads``) takes the plan the forward left (``network_bands.PLAN_KEY``) instead of
    planning again; the step's loss and gradients stay eager's (the test above)."""
    ids = token_ids(1, 600)
    model = patch(make_model("llama"), "fire", {"init_L": 32.0}, backend="chunked")
    model.train()
    with (
        _counted(network_bands, "plan_bands") as forward_plans,
        _counted(network_bands_backward, "plan_bands") as backward_plans,
        _counted(network_bands_backward, "RebuiltHeads") as rebuilt,
    ):
        model(ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    assert len(rebuilt) == layers * 2  # queries 256.. and 512..599, rebuilt in backward
    assert len(forward_plans) == layers * 2  # one plan per banded block, made in forward
    assert backward_plans == []
