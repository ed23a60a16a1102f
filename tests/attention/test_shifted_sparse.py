"""LongLoRA's shifted sparse attention (S2-Attn; Chen et al. 2024, arXiv:2309.12307, Algorithm 1).

Properties checked, each against a reference written here from the paper and LongLoRA's code
(never from hf_posenc's implementation):

* ``wrap=True`` equals the paper's pseudo-code: roll the second half of the heads by -G/2,
  reshape into groups of G, causal softmax attention inside each group, reshape back, roll by
  +G/2; values and gradients, several G and lengths, GQA with even and odd KV head counts.
* ``wrap=False`` (default) equals LongLoRA's flash-attention partition: head half 0 attends
  inside ``[mG, (m+1)G)``, half 1 inside ``[G/2 + mG, G/2 + (m+1)G)`` clipped to the sequence,
  written as an explicit per-head mask; with padding and document masks too.
* Positions: with RoPE every token of the shifted half keeps its absolute position (the model's
  layer output equals the grouped attention of q, k rotated by the true position ids).
* Inference (``model.eval()``) and a disabled S2 equal plain attention; bad settings raise one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import FAMILIES, ROTARY_FAMILIES, attention_modules, make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from references.attention import output_projection, projections
from references.config import native_rope
from references.rope import reference_inv_freq, rotation_matrix

import hf_posenc
from hf_posenc.attention.backend import AttentionCall
from hf_posenc.attention.shifted import ShiftedSparse, shifted_sparse_attention
from hf_posenc.core.shifted_sparse import s2_attn_settings
from hf_posenc.encodings.base import probe_call
from hf_posenc.errors import InvalidParameterError, NotPatchedError

SCALE = 0.3


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, H, T, D): KV head g serves query heads g*H/Hkv .. (g+1)*H/Hkv - 1."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def paper_s2(q, k, v, group: int) -> torch.Tensor:
    """Algorithm 1 of the LongLoRA paper, fp64: q (B, H, T, D), k/v (B, Hkv, T, D) -> (B, T, H, D)."""
    batch, heads, length, dim = q.shape
    k, v = _expand(k, heads), _expand(v, heads)
    count = length // group

    def shift(x):  # "qkv[:, :, H//2:] = qkv[:, :, H//2:].roll(-G//2, dims=...)", then groups
        x = torch.cat((x[:, : heads // 2], x[:, heads // 2 :].roll(-group // 2, dims=2)), dim=1)
        return (
            x.reshape(batch, heads, count, group, dim)
            .transpose(1, 2)
            .reshape(batch * count, heads, group, dim)
        )

    qs, ks, vs = shift(q), shift(k), shift(v)
    scores = qs @ ks.transpose(-1, -2) * SCALE  # (B*count, H, G, G)
    causal = torch.ones(group, group, dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vs  # (B*count, H, G, D)
    out = out.reshape(batch, count, heads, group, dim).transpose(1, 2).reshape(batch, heads, length, dim)
    out = torch.cat((out[:, : heads // 2], out[:, heads // 2 :].roll(group // 2, dims=2)), dim=1)  # roll back
    return out.transpose(1, 2)


def partition_mask(heads: int, length: int, group: int) -> torch.Tensor:
    """(H, T, T) bool: query i may attend key j <= i in its head's group. Head half 0: group i // G;
    half 1: group (i + G/2) // G (LongLoRA's cu_seqlens 0, G/2, 3G/2, ..., T)."""
    index = torch.arange(length)
    plain, shifted = index // group, (index + group // 2) // group
    same = lambda g: g[:, None] == g[None, :]  # noqa: E731
    causal = index[:, None] >= index[None, :]
    halves = [same(plain) & causal] * (heads // 2) + [same(shifted) & causal] * (heads // 2)
    return torch.stack(halves)


def masked_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale) v over ``allowed`` (broadcast to (B, H, T, T)), fp64 -> (B, T, H, D)."""
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1))  # a fully masked (padding) row: zeros
    return (weights @ v).transpose(1, 2)


def _encoding():
    return patch(make_model("llama"), "nope", randomize=False).posenc


def _call(q, k, v, mask=None, backend="sdpa") -> AttentionCall:
    enc = _encoding()
    base = probe_call(enc.geometry, q.shape[-2])
    return AttentionCall(
        score=dataclasses.replace(base, q=q, k=k),
        v=v,
        mask=mask,
        softmax_scale=SCALE,
        dropout_p=0.0,
        requested=backend,
        want_weights=False,
        encoding=enc,
        stages=frozenset(enc.active_stages()),
        bias=None,
        failures=set(),
    )


def _tensors(batch, heads, kv_heads, length, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim))
    return [torch.randn(s, generator=generator, dtype=torch.float64, requires_grad=True) for s in shapes]


def _check(settings_, want_fn, q, k, v, mask=None, backend="sdpa"):
    """Values and gradients (for one random cotangent) equal; eager's scores are fp32 (1e-5)."""
    tol = 1e-10 if backend == "sdpa" else 1e-5
    got = shifted_sparse_attention(_call(q, k, v, mask, backend), settings_)[0]
    want = want_fn(q, k, v)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    cotangent = torch.randn_like(want)
    grads = torch.autograd.grad((got * cotangent).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * cotangent).sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


GEOMETRIES = [(4, 2), (4, 1), (6, 3), (4, 4), (2, 2)]  # (query heads, KV heads): GQA even/odd, MQA, MHA
LENGTHS = [(8, 2), (16, 4), (16, 8), (24, 8), (12, 6), (8, 8), (32, 8)]  # (T, G)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(("length", "group"), LENGTHS)
@pytest.mark.parametrize(("heads", "kv_heads"), GEOMETRIES)
def test_wrapped_s2_equals_the_papers_algorithm(heads, kv_heads, length, group, backend):
    """wrap=True: values and gradients of q, k, v equal Algorithm 1 (roll, group, causal, roll back)."""
    q, k, v = _tensors(2, heads, kv_heads, length)
    _check(
        ShiftedSparse.of(group, wrap=True), lambda q, k, v: paper_s2(q, k, v, group), q, k, v, backend=backend
    )


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(("length", "group"), LENGTHS)
@pytest.mark.parametrize(("heads", "kv_heads"), GEOMETRIES)
def test_unwrapped_s2_equals_longloras_partition(heads, kv_heads, length, group, backend):
    """wrap=False: values and gradients equal attention under LongLoRA's flash partition, which
    never lets a token see a later one."""
    q, k, v = _tensors(2, heads, kv_heads, length)
    allowed = partition_mask(heads, length, group)[None]
    _check(
        ShiftedSparse.of(group), lambda q, k, v: masked_attention(q, k, v, allowed), q, k, v, backend=backend
    )


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 5),
    half=st.integers(1, 4),
    batch=st.integers(1, 3),
    heads_kv=st.sampled_from(GEOMETRIES),
    wrap=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_s2_matches_its_reference_for_any_grouping(count, half, batch, heads_kv, wrap, seed):
    """For every length = count * G and group G = 2 * half: the output equals its reference."""
    group, (heads, kv_heads) = 2 * half, heads_kv
    q, k, v = _tensors(batch, heads, kv_heads, count * group, dim=4, seed=seed)
    if wrap:
        want = paper_s2(q, k, v, group)
    else:
        want = masked_attention(q, k, v, partition_mask(heads, count * group, group)[None])
    got = shifted_sparse_attention(_call(q, k, v), ShiftedSparse.of(group, wrap=wrap))[0]
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_group_ratio_is_a_fraction_of_the_length():
    """group_size=0.25 (LongLoRA's default) on 32 tokens is G = 8; '1/4' is the same."""
    q, k, v = _tensors(1, 4, 2, 32)
    want = masked_attention(q, k, v, partition_mask(4, 32, 8)[None])
    for size in (0.25, "1/4"):
        got = shifted_sparse_attention(_call(q, k, v), ShiftedSparse.of(size))[0]
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_unwrapped_s2_honours_padding_and_document_masks():
    """A (B, 1, T, T) mask (left padding in row 0, two packed documents in row 1) is intersected
    with each head's groups."""
    length, group, heads = 16, 8, 4
    q, k, v = _tensors(2, heads, 2, length)
    index = torch.arange(length)
    causal = index[:, None] >= index[None, :]
    padded = causal & (index[None, :] >= 3)  # row 0: three padding tokens on the left
    documents = causal & ((index[:, None] >= 6) == (index[None, :] >= 6))  # row 1: documents 0..5, 6..15
    mask = torch.stack((padded, documents))[:, None]  # (2, 1, T, T)
    allowed = partition_mask(heads, length, group)[None] & mask
    _check(ShiftedSparse.of(group), lambda q, k, v: masked_attention(q, k, v, allowed), q, k, v, mask=mask)


def _rope_reference(model, hidden, positions, group, wrap):
    """Layer 0 of a RoPE llama, fp64, with S2-Attn: q_t, k_t rotated by their TRUE position
    ``positions[t]`` (RoFormer's formula), then the grouped attention of the references above."""
    module = attention_modules(model)[0]
    theta, _ = native_rope(model, 0)
    inv_freq, factor = reference_inv_freq({"theta": theta}, module.head_dim, positions.shape[-1])
    q, k, v = projections(module, hidden.double(), hidden.double())  # (B, T, H, D)
    rotations = torch.stack(
        [rotation_matrix(float(p), inv_freq, module.head_dim, factor) for p in positions[0]]
    )
    rotate = lambda x: torch.einsum("tij,bthj->bthi", rotations, x)  # noqa: E731  R(p_t) x_t
    q, k, v = (rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)
    global SCALE
    saved, SCALE = SCALE, module.scaling
    try:
        if wrap:
            out = paper_s2(q, k, v, group)
        else:
            out = masked_attention(q, k, v, partition_mask(q.shape[1], q.shape[2], group)[None])
    finally:
        SCALE = saved
    return output_projection(module, out.reshape(*out.shape[:2], -1))


@pytest.mark.parametrize("wrap", [False, True])
def test_rope_keeps_every_tokens_absolute_position(wrap):
    """With RoPE, the shifted heads rotate each token by its true position (here position ids with
    a jump, as PoSE gives): layer 0's output equals the reference that rotates by ``position_ids``
    before grouping. With wrap=True the last group joins tokens far apart, whose RoPE distance is
    their true one."""
    model = patch(make_model("llama"), "rope", randomize=False)
    ids = token_ids(2, 16)
    positions = torch.cat((torch.arange(6), torch.arange(20, 30)))[None].expand(2, -1)
    hf_posenc.enable_s2_attn(model, 8, wrap=wrap)
    model.train()
    captured = {}
    module = attention_modules(model)[0]
    handle = module.register_forward_hook(
        lambda mod, args, kwargs, output: captured.update(hidden=kwargs["hidden_states"], out=output[0]),
        with_kwargs=True,
    )
    try:
        model(ids, position_ids=positions)
    finally:
        handle.remove()
    want = _rope_reference(model, captured["hidden"].detach(), positions, 8, wrap)
    torch.testing.assert_close(captured["out"].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding", ["rope", "nope", "learned", "expe", "xpos"])
def test_inference_and_disabled_s2_are_plain_attention(encoding):
    """eval() with S2 on, and train() after disable_s2_attn, give the logits of the model without
    it; train() with S2 on gives others (the pattern is active). S2 leaves no trace in the config."""
    model = patch(make_model("llama"), encoding)
    ids = token_ids(2, 16)
    with torch.no_grad():
        plain = model(ids).logits
        hf_posenc.enable_s2_attn(model, 4)
        torch.testing.assert_close(model(ids).logits, plain, atol=0, rtol=0)
        model.train()
        assert (model(ids).logits - plain).abs().max() > 1e-4
        hf_posenc.disable_s2_attn(model)
        torch.testing.assert_close(model(ids).logits, plain, atol=1e-6, rtol=1e-6)
        with hf_posenc.s2_attn(model, 0.25):
            assert (model(ids).logits - plain).abs().max() > 1e-4
        torch.testing.assert_close(model(ids).logits, plain, atol=1e-6, rtol=1e-6)
    assert "s2" not in str(model.config.posenc)


@pytest.mark.parametrize(
    ("encoding", "size", "wrap", "message"),
    [
        ("alibi", 4, False, "cannot wrap encoding 'alibi'"),
        ("selfextend", 4, False, "cannot wrap encoding 'selfextend'"),
        ("rope", 3, False, "group size 3 is not allowed"),
        ("rope", 0, False, "group size 0 is not allowed"),
        ("rope", 1.5, False, "group size 1.5 is not allowed"),
        ("rope", "a/b", False, "group size 'a/b' is not allowed"),
        ("rope", 4, "yes", "wrap='yes' is not allowed"),
    ],
)
def test_bad_settings_are_one_line_before_any_forward(encoding, size, wrap, message):
    """An encoding S2 cannot wrap, an odd or non-positive group, a bad ratio: one line, nothing set."""
    model = patch(make_model("llama"), encoding, randomize=False)
    with pytest.raises(InvalidParameterError, match=message) as error:
        hf_posenc.enable_s2_attn(model, size, wrap=wrap)
    assert "\n" not in str(error.value)
    assert s2_attn_settings(model) is None


def test_unpatched_and_odd_head_models_are_refused():
    with pytest.raises(NotPatchedError, match="patch_model first"):
        hf_posenc.enable_s2_attn(make_model("llama"))
    odd = patch(make_model("llama", hidden_size=48, num_heads=3, num_kv_heads=1), "rope", randomize=False)
    with pytest.raises(InvalidParameterError, match="3 attention heads"):
        hf_posenc.enable_s2_attn(odd)


def test_lengths_the_groups_do_not_cut_are_refused_in_one_line():
    """A training forward whose length the group does not divide (or whose ratio gives an odd or
    fractional group) stops with one line naming the group and the length."""
    model = patch(make_model("llama"), "rope", randomize=False)
    model.train()
    for size, length, message in (
        (8, 12, "group size 8 does not cut a sequence of 12"),
        (0.25, 20, "(5 tokens)"),
    ):
        hf_posenc.enable_s2_attn(model, size)
        with pytest.raises(
            InvalidParameterError, match=message.replace("(", r"\(").replace(")", r"\)")
        ) as error:
            model(token_ids(1, length))
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("wrap", [False, True])
def test_s2_on_every_family_is_causal_in_groups(family, wrap):
    """On every family (its own RoPE or, without one, learned positions), training with S2-Attn:
    unwrapped, the first G/2 tokens see exactly what full attention shows them (same logits), later
    ones less (other logits), and a change to the last token reaches no earlier logit; wrapped (the
    paper's rolled form), the first G/2 tokens see the last G/2, so that change reaches them.
    Gradients flow; eval() is the plain model."""
    encoding = "rope" if family in ROTARY_FAMILIES else "learned"
    model = patch(make_model(family), encoding)
    length, group = 16, 8
    ids = token_ids(2, length)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50 + 3
    with torch.no_grad():
        full = model(ids).logits
    hf_posenc.enable_s2_attn(model, group, wrap=wrap)
    model.train()
    if wrap and getattr(model.config, "sliding_window", None):  # a sliding window is a mask
        with pytest.raises(InvalidParameterError, match="wrap=True .* with an attention mask"):
            model(ids)
        return
    s2 = model(ids).logits
    s2.float().pow(2).mean().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with torch.no_grad():
        if not wrap:
            torch.testing.assert_close(s2[:, : group // 2], full[:, : group // 2], atol=1e-5, rtol=1e-5)
        assert (s2[:, group // 2 :] - full[:, group // 2 :]).abs().max() > 1e-4
        reach = (model(changed).logits[:, : group // 2] - s2[:, : group // 2]).abs().max()
        assert (reach > 1e-4) if wrap else (reach < 1e-5), float(reach)
        model.eval()
        torch.testing.assert_close(model(ids).logits, full, atol=1e-5, rtol=1e-5)
