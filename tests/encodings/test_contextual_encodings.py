"""CoPE, stick-breaking attention (SBA) and CAPE: their starting points and own properties,
parameter validation. Their formula references (tests/references/cope.py, sba.py, cape.py) are
checked against every patched layer by tests/encodings/test_formula_references.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import make_model, token_ids
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.encodings import cape
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.cope import contextual_positions, interpolate_position_logits
from hf_posenc.encodings.sba import stick_breaking_weights

SETTINGS = settings(max_examples=40, deadline=None)


# -- CAPE's head mixer -------------------------------------------------------------------------


def _mixed_formula(mixer, scores, bias):
    """x + B + W2 leaky_relu(W1 [x; B] + b1, 0.01) + b2 per (b, i, j), over heads, in fp64."""
    w1, b1 = mixer.inner.weight.double(), mixer.inner.bias.double()
    w2, b2 = mixer.outer.weight.double(), mixer.outer.bias.double()
    u = torch.cat([scores.double(), bias.double().expand_as(scores)], dim=1)  # (B, 2H, R, K)
    hidden = torch.nn.functional.leaky_relu(torch.einsum("fc,bcrk->bfrk", w1, u) + b1[:, None, None], 0.01)
    return scores + bias + torch.einsum("hf,bfrk->bhrk", w2, hidden) + b2[:, None, None]


def test_cape_mixer_takes_a_block_in_one_slab_off_the_cpu(monkeypatch):
    """Without gradients the mix goes in cache-sized slabs on the CPU only: on another device (a
    GPU, where each slab is five kernel launches) a block is one slab per batch row, as the mix
    with gradients takes it. Counted on the meta device, which runs the same code without data."""
    assert cape.mix_slab(torch.device("cpu"), 10**6) == cape.MIX_SLAB
    assert cape.mix_slab(torch.device("cpu"), 100) == 100
    assert cape.mix_slab(torch.device("cuda"), 10**6) == 10**6
    assert cape.mix_slab(torch.device("cuda"), 0) == 1  # a block of no keys
    activations = []
    original = cape.F.leaky_relu_
    monkeypatch.setattr(
        cape.F, "leaky_relu_", lambda x, slope: activations.append(x.shape) or original(x, slope)
    )
    for device, slabs in (("meta", 2), ("cpu", 2 * -(-64 * 300 // cape.MIX_SLAB))):
        activations.clear()
        mixer = cape.HeadMixer(4, 6).to(device)
        scores = torch.zeros(2, 4, 64, 300, device=device)
        with torch.no_grad():
            mixer.mix(scores, torch.zeros(1, 4, 64, 300, device=device))
        assert len(activations) == slabs, (device, activations)


@SETTINGS
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    rows=st.integers(1, 6),
    keys=st.integers(0, 9),
    slab=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
@example(batch=2, heads=3, rows=2, keys=0, slab=5, seed=0)  # a block of no keys
@example(batch=1, heads=4, rows=6, keys=9, slab=7, seed=1)  # slabs cutting rows, the last one short
def test_cape_mixer_equals_its_formula_in_slabs_and_with_gradients(batch, heads, rows, keys, slab, seed):
    """CAPE's f over the heads (head-major products): without gradients over slabs of any size
    (the last one short), with gradients in one piece, both equal the formula per score in fp64
    (eq. 4 of Zheng et al. 2024), and so do the gradients of the scores, the bias and the MLP."""
    generator = torch.Generator().manual_seed(seed)
    mixer = cape.HeadMixer(heads, 6)
    with torch.no_grad():
        for parameter in mixer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    scores = torch.randn(batch, heads, rows, keys, generator=generator)
    bias = torch.randn(1, heads, rows, keys, generator=generator)  # shared by the batch, as alibi's
    expected = _mixed_formula(mixer, scores, bias)
    original = cape.MIX_SLAB
    try:
        cape.MIX_SLAB = slab
        with torch.no_grad():
            torch.testing.assert_close(mixer.mix(scores, bias).double(), expected, atol=1e-5, rtol=1e-5)
    finally:
        cape.MIX_SLAB = original
    leaves = (scores.requires_grad_(), bias.requires_grad_())
    weight = torch.randn(batch, heads, rows, keys, generator=generator)
    got = torch.autograd.grad((mixer.mix(*leaves) * weight).sum(), (*leaves, *mixer.parameters()))
    wanted = torch.autograd.grad(
        (_mixed_formula(mixer, *leaves) * weight).sum(), (*leaves, *mixer.parameters())
    )
    for g, w in zip(got, wanted, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-5)


# -- starting points --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "start"), [("cope", "nope"), ("cape", "alibi")])
def test_fresh_patch_starts_as_its_base(family, name, start):
    """Freshly patched (no training), CoPE gives NoPE's logits (zero position embeddings) and
    CAPE gives ALiBi's (zero MLP output layer): a pretrained model starts from a known point."""
    ids = token_ids(2, 10)
    with torch.no_grad():
        ours = hf_posenc.patch_model(make_model(family), name)(ids).logits
        base = hf_posenc.patch_model(make_model(family), start)(ids).logits
    torch.testing.assert_close(ours, base, atol=1e-5, rtol=0)


# -- CoPE properties --------------------------------------------------------------------------


def causal(q_len: int, k_len: int) -> torch.Tensor:
    return torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]


@SETTINGS
@given(
    length=st.integers(1, 40),
    npos_max=st.integers(2, 50),
    head_dim=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_cope_with_all_gates_open_is_a_relative_bias(length, npos_max, head_dim, seed):
    """With every gate g_it = 1, p_ij = i - j + 1 (the reference's sum includes key i itself),
    clamped to npos_max - 1, for every allowed key, and the added logit is q_i . e[p_ij]: CoPE
    reduces to a relative position bias on i - j. Masked (future) keys get position 0."""
    generator = torch.Generator().manual_seed(seed)
    allowed = causal(length, length)
    positions = contextual_positions(torch.ones(length, length, dtype=torch.float64), allowed, npos_max)
    i, j = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    expected = torch.where(allowed, (i - j + 1).clamp(max=npos_max - 1), 0).double()
    assert torch.equal(positions, expected)
    q = torch.randn(length, head_dim, generator=generator, dtype=torch.float64)
    table = torch.randn(npos_max, head_dim, generator=generator, dtype=torch.float64)
    added = interpolate_position_logits(q @ table.T, positions)  # (Tq, Tk)
    for a in range(length):
        for b in range(a + 1):
            assert added[a, b].item() == pytest.approx(float(q[a] @ table[min(a - b + 1, npos_max - 1)]))


@SETTINGS
@given(length=st.integers(1, 30), pad=st.integers(0, 10), seed=st.integers(0, 2**16))
def test_cope_positions_ignore_masked_keys_and_interpolate_linearly(length, pad, seed):
    """Contextual positions count only allowed keys: left-padding keys change nothing for the
    real ones; positions decrease along the keys; the interpolated logit lies on the segment
    between z[floor p] and z[ceil p] at fraction p - floor p."""
    generator = torch.Generator().manual_seed(seed)
    gates = torch.rand(length, length, generator=generator, dtype=torch.float64)
    alone = contextual_positions(gates, causal(length, length), 10_000)
    padded_gates = torch.cat([torch.rand(length, pad, generator=generator, dtype=torch.float64), gates], -1)
    allowed = causal(length, length + pad)
    allowed[:, :pad] = False
    padded = contextual_positions(padded_gates, allowed, 10_000)
    torch.testing.assert_close(padded[:, pad:], alone, atol=1e-12, rtol=0)
    assert (alone[:, :-1] >= alone[:, 1:]).all()
    z = torch.randn(length, 10_000, generator=generator, dtype=torch.float64)
    p = alone
    got = interpolate_position_logits(z, p)
    lo, hi = z.gather(-1, p.floor().long()), z.gather(-1, p.ceil().long())
    torch.testing.assert_close(got, lo + (hi - lo) * (p - p.floor()), atol=1e-12, rtol=0)


# -- SBA properties ----------------------------------------------------------------------------


@functools.cache
def diagonal_mask(q_len: int, k_len: int) -> torch.Tensor:
    return torch.arange(k_len)[None, :] == torch.arange(k_len - q_len, k_len)[:, None]


@SETTINGS
@given(
    q_len=st.integers(1, 16),
    extra=st.integers(0, 16),
    scale=st.floats(0.01, 1e4),
    pad=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_stick_breaking_weights_are_nonnegative_and_sum_to_at_most_one(q_len, extra, scale, pad, seed):
    """For any logits (up to |z| ~ 1e4) and any mask, stick-breaking weights are finite,
    non-negative, zero on keys off the stick, and sum to at most 1 per query; with the
    remainder given to the current token (the reference's default) each row sums to 1."""
    k_len = q_len + extra
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, q_len, k_len, generator=generator) * scale
    allowed = causal(q_len, k_len).clone()[None, None].repeat(2, 1, 1, 1)
    allowed[1, ..., : min(pad, k_len - 1)] = False  # left padding in the second row
    weights = stick_breaking_weights(scores, allowed)
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all()
    assert (weights[~allowed.expand_as(weights)] == 0).all()
    assert (weights.sum(-1) <= 1 + 1e-6).all()

    model = hf_posenc.patch_model(make_model("llama"), "sba")
    ctx = probe_call(model.posenc.geometry, q_len, k_len)
    full = model.posenc.normalize(ctx.with_allowed(allowed), scores)
    assert (full >= 0).all()
    torch.testing.assert_close(full.sum(-1), torch.ones(2, 3, q_len), atol=1e-5, rtol=0)
    off_diagonal = ~diagonal_mask(q_len, k_len)
    torch.testing.assert_close(full * off_diagonal, stick_breaking_weights(scores, allowed & off_diagonal))


@SETTINGS
@given(length=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_stick_breaking_equals_the_product_formula(length, seed):
    """The log-space computation equals A_ij = beta_ij prod_{j<k<=i} (1 - beta_ik) multiplied out."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(length, length, generator=generator, dtype=torch.float64) * 3
    allowed = causal(length, length)
    got = stick_breaking_weights(scores, allowed).double()
    beta = torch.sigmoid(scores)
    for i in range(length):
        for j in range(length):
            want = beta[i, j] * math.prod(1 - beta[i, k] for k in range(j + 1, i + 1)) if j <= i else 0.0
            assert got[i, j].item() == pytest.approx(float(want), abs=1e-6)


# -- parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("cope", {"npos_max": 1}, r"npos_max=1 .*\[2"),
        ("cope", {"npos_max": 8.5}, r"npos_max=8.5 .*integer"),
        ("cope", {"shared_across_layers": "yes"}, r"shared_across_layers='yes'"),
        ("sba", {"remainder": "rest"}, r"remainder='rest' .*'current', 'drop'"),
        ("sba", {"attend_current": 1}, r"attend_current=1 .*True or False"),
        ("cape", {"base": "rope"}, r"base='rope' .*'alibi'"),
        ("cape", {"hidden": 0}, r"hidden=0 .*\[1"),
        ("cape", {"base_params": {"slope": 1.0}}, r"base_params for base 'alibi'.*'slope'"),
        ("cape", {"base_params": [1]}, r"base_params=\[1\]"),
    ],
)
def test_bad_parameters_are_rejected_with_value_and_range(name, params, message):
    """A bad value raises InvalidParameterError naming the value and what is allowed."""
    with pytest.raises(hf_posenc.InvalidParameterError, match=message):
        hf_posenc.patch_model(make_model("gpt2"), name, **params)


def test_listing_names_the_stages_and_defaults():
    """list_encodings shows each encoding's stage, default parameters and aliases."""
    infos = {info.name: info for info in hf_posenc.list_encodings()}
    assert infos["cope"].stages == ("transform_scores",)
    assert infos["cope"].parameters == {"npos_max": 64, "shared_across_layers": False}
    assert infos["sba"].stages == ("normalize",)
    assert infos["sba"].parameters == {"attend_current": False, "remainder": "current"}
    assert infos["cape"].stages == ("transform_scores",)
    assert infos["cape"].parameters == {"base": "alibi", "hidden": 32, "base_params": None}
    assert "dape" in infos["cape"].aliases and "stickbreaking" in infos["sba"].aliases
