"""The ``saturating_band`` backend: CoPE attended as an explicit band of keys near each block of
queries plus one fused kernel call over the keys before it, where every contextual position is
clamped at ``npos_max - 1`` (the logit there is ``q.k s + q.e[npos_max - 1] s``), merged by
log-sum-exp, with an FA-2 style backward whose band goes through autograd. Checked against CoPE's
formula written out in fp64 here (gates, reversed sums, clamp, interpolation; not the encoding's
code), through whole patched models against the eager backend, and for what autograd keeps.
"""

from __future__ import annotations

import pytest
import torch
from capture import saved_storages
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.attention import saturating_band
from hf_posenc.encodings.cope import CountedPositions


def reference(q, k, v, table, scale, position_scale):
    """fp64 CoPE attention, causal, k/v heads repeated for grouped queries -> (B, T, Hq, D):
    g_ij = sigmoid(q_i.k_j s), p_ij = min(sum_{t=j}^{i} g_it, npos - 1),
    logit_ij = q_i.k_j s + ((1 - w) q_i.e[floor p] + w q_i.e[ceil p]) s_pos, w = p - floor p."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length, npos = q.shape[-2], table.shape[0]
    causal = torch.arange(length)[None, :] <= torch.arange(length)[:, None]  # (T, T) j <= i
    scores = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)
    gates = torch.sigmoid(scores) * causal
    # p_ij = sum over t from j to i: total of the row minus the sum over t < j
    before = torch.cumsum(gates, -1) - gates  # sum_{t < j}
    counts = gates.sum(-1, keepdim=True) - before  # future keys (masked below): ~0, rounded
    positions = counts.clamp(min=0, max=npos - 1)
    z = q @ table.T  # (B, H, T, npos)
    low, high = positions.floor(), positions.ceil()
    weight = positions - low
    interpolated = z.gather(-1, low.long()) * (1 - weight) + z.gather(-1, high.long()) * weight
    logits = (scores + interpolated * position_scale).masked_fill(~causal, float("-inf"))
    return (torch.softmax(logits, dim=-1) @ v).transpose(1, 2)


def _check(batch, kv_heads, groups, length, npos, block, band_keys, gate_shift, dtype, seed, atol):
    generator = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * groups, 4
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype) for _ in range(2))
    # a shared key component moves every gate up or down: gates near 0 never saturate (the band
    # grows back to key 0), gates near 1 saturate after npos keys
    k = k + gate_shift * q.mean(dim=(1, 2), keepdim=True)[:, :1].expand_as(k)
    table = torch.randn(npos, dim, generator=generator, dtype=dtype)
    grad = torch.randn(batch, length, heads, dim, generator=generator, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    form = CountedPositions(leaves[3], npos, 0.7)
    out = saturating_band.attend_saturating_band(
        *leaves[:3], form=form, softmax_scale=0.6, block=block, band_keys=band_keys
    )
    got = torch.autograd.grad((out * grad).sum(), leaves)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, table)]
    want = reference(*leaves64, 0.6, 0.7)
    wanted = torch.autograd.grad((want * grad.double()).sum(), leaves64)
    # tolerances relative to each tensor's largest value (gradients of q reach ~10 here)
    for name, g, w in zip(
        ("out", "q", "k", "v", "table"), (out, *got), (want.detach(), *wanted), strict=True
    ):
        torch.testing.assert_close(
            g.double(), w, atol=atol * max(1.0, w.abs().max().item()), rtol=atol, msg=name
        )


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3),
    length=st.integers(1, 70),
    npos=st.integers(2, 8),
    block=st.integers(1, 12),
    band_keys=st.integers(1, 20),
    gate_shift=st.sampled_from([-3.0, 0.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_outputs_and_gradients_equal_the_formula_in_fp64(
    batch, kv_heads, groups, length, npos, block, band_keys, gate_shift, seed
):
    """For every length, block, first band width, grouped-query shape, batch and gate level
    (rows that saturate within a few keys, and rows that never do): output and gradients of q,
    k, v and the position table equal autograd of the written-out formula (fp64, 1e-10)."""
    _check(batch, kv_heads, groups, length, npos, block, band_keys, gate_shift, torch.float64, seed, 1e-10)


@pytest.mark.parametrize("gate_shift", [-3.0, 0.0, 3.0])
def test_outputs_and_gradients_equal_the_formula_in_fp32(gate_shift):
    """fp32 within 1e-5 (relative to each tensor's largest value) of the fp64 formula at a length
    where most keys are far (T = 300, npos 6, blocks of 16, grouped-query heads, a batch of two);
    the same formula written out in fp32 is 1e-4 - 5e-4 away (its sums run over whole rows)."""
    _check(2, 2, 2, 300, 6, 16, 8, gate_shift, torch.float32, 0, 1e-5)


def test_far_keys_are_attended_by_the_fused_kernel(monkeypatch):
    """With gates near 1/2 and npos 4 the band of a block ends a few keys before it: the blocks
    past the first band width take a far part (their band starts after key 0)."""
    starts = []
    forward = saturating_band.BandPlan.forward

    def spy(self, form, q, k, v):
        out, lse, firsts = forward(self, form, q, k, v)
        starts.extend(firsts)
        return out, lse, firsts

    monkeypatch.setattr(saturating_band.BandPlan, "forward", spy)
    q, k, v = (torch.randn(1, 2, 200, 4) * 0.1 for _ in range(3))
    form = CountedPositions(torch.randn(4, 4), 4, 0.5)
    saturating_band.attend_saturating_band(q, k, v, form=form, softmax_scale=0.5, block=16, band_keys=16)
    assert starts[0] == 0 and all(0 < first <= 200 - 16 for first in starts[2:]), starts


def _model(backend, params, dtype=torch.float32, **overrides):
    model = patch(make_model("llama", **overrides), "cope", params, backend=backend).to(dtype)
    with torch.no_grad():  # CoPE's table starts at zero: give it values, the same in both models
        model.posenc.embeddings.copy_(
            torch.randn(model.posenc.embeddings.shape, generator=torch.Generator().manual_seed(5))
        )
    return model.train()


@pytest.mark.parametrize("by_hand", [True, False], ids=["band-backward-by-hand", "band-through-autograd"])
@pytest.mark.parametrize(
    ("params", "batch", "length"),
    [({"npos_max": 4}, 2, 300), ({"npos_max": 4, "shared_across_layers": True}, 1, 200)],
    ids=["gqa-batch2", "shared-table"],
)
def test_patched_model_training_equals_eager(params, batch, length, by_hand, monkeypatch):
    """A patched Llama (grouped-query heads: 4 q / 2 kv) trained on the default backend, the band's
    backward by hand (``CountedPositions.band_with_gradients``, checked: it ran) or through
    autograd: logits and every parameter's gradient (the position tables' included) equal the
    eager backend's (fp32, 1e-5 relative to each tensor's largest value), and the saturating
    band served every attention call. (The eager path computes explicit scores in fp32 whatever
    the model's dtype, so fp64 exactness is checked on the function above, not here.)"""
    served = []
    attend = saturating_band.attend_saturating_band
    monkeypatch.setattr(
        saturating_band, "attend_saturating_band", lambda *a, **kw: served.append(1) or attend(*a, **kw)
    )
    monkeypatch.setattr(CountedPositions, "backward_by_hand", by_hand)
    hand_bands = []
    band_with_gradients = CountedPositions.band_with_gradients
    monkeypatch.setattr(
        CountedPositions,
        "band_with_gradients",
        lambda self, *a: hand_bands.append(1) or band_with_gradients(self, *a),
    )
    ids = token_ids(batch, length)
    results = []
    for backend in ("auto", "eager"):
        model = _model(backend, params)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), grads))
    assert len(served) == model.config.num_hidden_layers
    blocks = model.config.num_hidden_layers * -(-length // saturating_band.BLOCK)
    assert len(hand_bands) == (blocks if by_hand else 0)
    (logits, grads), (eager_logits, eager_grads) = results
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == eager_grads.keys() and "posenc.embeddings" in grads
    for name, grad in grads.items():
        want = eager_grads[name]
        torch.testing.assert_close(
            grad, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5, msg=name
        )


def test_padding_and_decoding_take_the_explicit_paths(monkeypatch):
    """Calls with a padding mask or a cache (Tq != Tk) are not the band's: they are served as
    before, and the results equal eager's."""
    served = []
    attend = saturating_band.attend_saturating_band
    monkeypatch.setattr(
        saturating_band, "attend_saturating_band", lambda *a, **kw: served.append(1) or attend(*a, **kw)
    )
    ids = token_ids(2, 40)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    logits = [
        _model(backend, {"npos_max": 4}).eval()(ids, attention_mask=mask, use_cache=False).logits
        for backend in ("auto", "eager")
    ]
    assert not served
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_training_keeps_no_score_sized_tensor():
    """What autograd keeps for a training step through the band: q, k, v, the output, its
    log-sum-exp and the table, no tensor of one head's T x T scores or more (the eager path keeps
    several (B, H, T, T) gates, positions and weights per layer)."""
    model = _model("auto", {"npos_max": 4})
    length = 512
    with saved_storages() as storages:
        loss = model(token_ids(1, length), labels=token_ids(1, length), use_cache=False).loss
    loss.backward()
    assert max(storages.values()) < length * length * 4, max(storages.values())


def stick_breaking_reference(q, k, v, scale, attend_current, remainder):
    """fp64 stick-breaking attention (Tan et al. 2024), causal, k/v repeated for grouped queries ->
    (B, T, Hq, D): A_ij = sigmoid(z_ij) prod_{j < t, t in S_i} (1 - sigmoid(z_it)) for j in S_i
    (S_i: keys before i, or up to i with ``attend_current``), the leftover 1 - sum_j A_ij added
    to key i with ``remainder="current"``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length = q.shape[-2]
    rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
    stick = cols <= rows if attend_current else cols < rows  # (T, T) S_i
    z = q @ k.transpose(-1, -2) * scale
    log_keep = torch.nn.functional.logsigmoid(-z) * stick
    after = log_keep.sum(-1, keepdim=True) - torch.cumsum(log_keep, -1)  # sum over t > j
    weights = torch.exp(torch.nn.functional.logsigmoid(z) + after) * stick
    if remainder == "current":
        weights = weights + (1 - weights.sum(-1, keepdim=True)) * (cols == rows)
    return (weights @ v).transpose(1, 2)


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 2),
    length=st.integers(1, 60),
    block=st.integers(1, 12),
    band_keys=st.integers(1, 16),
    pull=st.sampled_from([0.0, 3.0, 5.0]),
    attend_current=st.booleans(),
    remainder=st.sampled_from(["current", "drop"]),
    seed=st.integers(0, 2**16),
)
def test_stick_breaking_band_equals_the_formula(
    kv_heads, groups, length, block, band_keys, pull, attend_current, remainder, seed
):
    """Stick-breaking over each block's band (keys before it have weights below fp32's smallest
    normal, which the eager path flushes to 0): output and gradients of q, k, v within 1e-5 of the
    fp64 formula (relative to each tensor's largest value; the weights are fp32 as on the eager
    path). ``pull`` adds a shared direction to q and k: scores near +pull^2 s break the stick within
    a few keys, so most blocks leave the keys before their band out."""
    from hf_posenc.encodings.sba import StickBreakingBand

    generator = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * groups, 4
    shared = torch.randn(dim, generator=generator)
    shared = shared / shared.norm() * pull
    q = torch.randn(2, heads, length, dim, generator=generator) + shared
    k = torch.randn(2, kv_heads, length, dim, generator=generator) + shared
    v = torch.randn(2, kv_heads, length, dim, generator=generator)
    grad = torch.randn(2, length, heads, dim, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    form = StickBreakingBand(attend_current, remainder)
    out = saturating_band.attend_saturating_band(
        *leaves, form=form, softmax_scale=0.6, block=block, band_keys=band_keys
    )
    got = torch.autograd.grad((out * grad).sum(), leaves)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = stick_breaking_reference(*leaves64, 0.6, attend_current, remainder)
    wanted = torch.autograd.grad((want * grad.double()).sum(), leaves64)
    for name, g, w in zip(("out", "q", "k", "v"), (out, *got), (want.detach(), *wanted), strict=True):
        torch.testing.assert_close(
            g.double(), w, atol=1e-5 * max(1.0, w.abs().max().item()), rtol=1e-5, msg=name
        )


@pytest.mark.parametrize("by_hand", [True, False], ids=["band-backward-by-hand", "band-through-autograd"])
@pytest.mark.parametrize("params", [{}, {"attend_current": True, "remainder": "drop"}], ids=str)
def test_stick_breaking_model_training_equals_eager(params, by_hand, monkeypatch):
    """A patched Llama (4 q / 2 kv heads, a batch of two, T = 300) trained with ``sba`` on the
    default backend, the band's backward by hand (``StickBreakingBand.band_with_gradients``,
    checked: it ran) or through autograd: logits and every parameter's gradient equal the eager
    backend's (fp32, 1e-5 relative to each tensor's largest value), the band served every layer
    and left keys out."""
    from hf_posenc.encodings.sba import StickBreakingBand

    monkeypatch.setattr(StickBreakingBand, "backward_by_hand", by_hand)
    hand_bands: list[int] = []
    band_with_gradients = StickBreakingBand.band_with_gradients
    monkeypatch.setattr(
        StickBreakingBand,
        "band_with_gradients",
        lambda self, *a: hand_bands.append(1) or band_with_gradients(self, *a),
    )
    firsts: list[int] = []
    forward = saturating_band._vanishing_forward

    def spy(*args):
        out, starts = forward(*args)
        firsts.extend(starts)
        return out, starts

    monkeypatch.setattr(saturating_band, "_vanishing_forward", spy)
    ids = token_ids(2, 300)
    results = []
    for backend in ("auto", "eager"):
        model = patch(make_model("llama"), "sba", params, backend=backend).train()
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        results.append(
            (out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    assert firsts and max(firsts) > 0
    assert len(hand_bands) == (len(firsts) if by_hand else 0)  # once per block of the patched run
    (logits, grads), (eager_logits, eager_grads) = results
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        want = eager_grads[name]
        torch.testing.assert_close(
            grad, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5, msg=name
        )
