"""The neighbour backend (hf_posenc/attention/neighbour.py: near band and far keys of each query
block as two softmax parts merged by log-sum-exp, with a backward from the merged statistics):

- for all inputs (hypothesis: sizes, grouped-query heads, windows, blocks, packed documents with
  restarting positions, left padding, cached keys, any far map), its output and the gradients
  of every input equal an fp64 reference written from the definition — one softmax over every
  allowed key, each key's logit under the near map where ``q_pos - k_pos < window`` and under the
  far map elsewhere — on both part kernels (torch's fused CPU kernel and explicit scores);
- training keeps no score tensor: no (B, H, rows, keys) tensor is created in forward or
  backward, and the bytes saved for backward grow linearly with the length, as native RoPE's;
- a patched model equals the eager backend (explicit (T, T) logits) in loss and every gradient,
  with packed documents and with left padding; in bf16 it is no further from fp32 than eager.
"""

from __future__ import annotations

import pytest
import torch
from capture import saved_storages
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from packing_cases import documents, packed, patched
from torch.utils._python_dispatch import TorchDispatchMode

import hf_posenc.attention.chunked as chunked
from hf_posenc.attention.core import attend
from hf_posenc.attention.neighbour import attend_neighbour, attend_remade
from hf_posenc.encodings.call import NeighbourSplit


def reference(split: NeighbourSplit, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64, from the definition: softmax over the allowed keys of the logits chosen per (query,
    key) pair by position distance; (B, Tq, Hq, D). Rows without an allowed key are 0."""
    groups = split.near_q.shape[1] // split.near_k.shape[1]

    def logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        k = k.double().repeat_interleave(groups, dim=1)
        return q.double() @ k.transpose(-1, -2) * scale

    distance = split.q_positions[:, :, None] - split.k_positions[:, None, :]  # (B, Tq, Tk)
    near = (distance < split.window)[:, None]
    scores = torch.where(near, logits(split.near_q, split.near_k), logits(split.far_q, split.far_k))
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all -inf row: NaN -> 0
    return (weights @ v.double().repeat_interleave(groups, dim=1)).transpose(1, 2)


@st.composite
def neighbour_inputs(draw):
    """A random call: per row, left padding then documents with positions restarting at each
    (base offset arbitrary), the last Tq of Tk tokens as queries (keys of earlier steps cached)."""
    batch, kv_heads, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    k_len = draw(st.integers(1, 14))
    q_len = draw(st.integers(1, k_len))
    plain = draw(st.booleans())  # one document per row, no padding: the call's mask is None (causal)
    positions, allowed = [], []
    for _ in range(batch):
        pad = 0 if plain else draw(st.integers(0, k_len - 1))
        cuts = (
            []
            if plain or pad + 1 >= k_len
            else sorted(draw(st.lists(st.integers(pad + 1, k_len - 1), max_size=3, unique=True)))
        )
        starts = [pad, *cuts]
        doc = torch.full((k_len,), -1)  # padding: no document
        pos = torch.ones(k_len, dtype=torch.long)  # padding positions as transformers' (any value)
        base = draw(st.integers(0, 5))
        for d, (start, stop) in enumerate(zip(starts, [*starts[1:], k_len], strict=True)):
            doc[start:stop] = d
            pos[start:stop] = base + torch.arange(stop - start)
        same = (doc[:, None] == doc[None, :]) & (doc[None, :] >= 0)
        causal = torch.ones(k_len, k_len, dtype=torch.bool).tril()
        positions.append(pos)
        allowed.append((same & causal)[k_len - q_len :])
    head_dim = draw(st.sampled_from([2, 4]))
    return {
        "shape": (batch, kv_heads, groups, q_len, k_len, head_dim),
        "positions": torch.stack(positions),
        "allowed": torch.stack(allowed)[:, None],  # (B, 1, Tq, Tk)
        "window": draw(st.integers(1, 6)),
        "block": draw(st.integers(1, 6)),
        "seed": draw(st.integers(0, 2**16)),
        "plain": plain,
        "wider_values": draw(st.sampled_from([0, 0, 0, 1])),  # values wider than q/k: explicit kernel
    }


def make_split(inputs, dtype):
    batch, kv_heads, groups, q_len, k_len, head_dim = inputs["shape"]
    generator = torch.Generator().manual_seed(inputs["seed"])

    def rand(heads, length, dim=head_dim):
        x = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
        return x.to(dtype).requires_grad_()

    tensors = {
        "near_q": rand(kv_heads * groups, q_len),
        "near_k": rand(kv_heads, k_len),
        "far_q": rand(kv_heads * groups, q_len),  # an arbitrary far map: any rotation, leaky too
        "far_k": rand(kv_heads, k_len),
    }
    positions = inputs["positions"]
    split = NeighbourSplit(
        inputs["window"], **tensors, q_positions=positions[:, k_len - q_len :], k_positions=positions
    )
    return split, rand(kv_heads, k_len, head_dim + inputs["wider_values"]), tensors


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=40, deadline=None)
@given(inputs=neighbour_inputs())
def test_output_and_gradients_equal_the_definition_for_all_inputs(inputs, dtype, fused):
    """Values and gradients of near_q, near_k, far_q, far_k and v (fp64 to 1e-10, fp32 to 1e-5);
    a query with no allowed key (left padding) gives 0 and passes no gradient."""
    split, v, tensors = make_split(inputs, dtype)
    allowed = inputs["allowed"]
    mask = None if inputs["plain"] else allowed
    out = attend_neighbour(split, v, mask=mask, softmax_scale=0.7, block=inputs["block"], fused=fused)
    expected = reference(split, v, allowed, 0.7)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs_ = [*tensors.values(), v]
    got = torch.autograd.grad((out.double() * weights).sum(), inputs_)
    want = torch.autograd.grad((expected * weights).sum(), inputs_)
    for name, g, w in zip([*tensors, "v"], got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=tol * 10, rtol=tol * 10, msg=name)


class ShapeLog(TorchDispatchMode):
    """Records the shape of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.float_masks: list[tuple[int, ...]] = []  # 4-d floating tensors with one head: additive masks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for r in result if isinstance(result, tuple | list) else (result,):
            if isinstance(r, torch.Tensor):
                self.shapes.append(tuple(r.shape))
                if r.is_floating_point() and r.dim() == 4 and r.shape[1] == 1:
                    self.float_masks.append(tuple(r.shape))
        return result


def _call(length: int, dtype=torch.float32):
    """One call of 2 rows, 4 query heads over 2 key heads, head width 8, window 16, blocks of 8."""
    generator = torch.Generator().manual_seed(0)

    def rand(heads, dim=8):
        return torch.randn(2, heads, length, dim, generator=generator, dtype=dtype).requires_grad_()

    positions = torch.arange(length).expand(2, length)
    split = NeighbourSplit(16, rand(4), rand(2), rand(4), rand(2), positions, positions)
    return split, rand(2)


def test_training_creates_no_score_tensor():
    """Forward and backward on CPU (the fused kernel): no tensor with several heads and a key
    dimension exists (a (B, H, rows, keys) score or weight tensor); the per-block masks have one head
    and, with no padding mask, span only the band's keys. The explicit kernel, used off CPU, does
    build score tensors (the check sees them)."""
    for fused, builds_scores in ((True, False), (False, True)):
        split, v = _call(96)
        with ShapeLog() as log:
            out = attend_neighbour(split, v, mask=None, softmax_scale=0.3, block=8, fused=fused)
            out.square().sum().backward()
        scores = [s for s in log.shapes if len(s) == 4 and s[1] > 1 and s[-1] > 8]
        assert bool(scores) == builds_scores, scores[:3]
        # the far keys before each block's band go unmasked: masks span at most the band (8 + 16 - 1 keys)
        assert log.float_masks and max(s[-1] for s in log.float_masks) <= 23, log.float_masks


def _saved_bytes(run) -> int:
    """Bytes of the tensors autograd saves for backward while ``run()`` computes a loss."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def test_saved_state_grows_linearly_as_native_ropes(monkeypatch):
    """Bytes saved for backward by a training forward of a patched model at 256 and 512 tokens
    (blocks of 32): the per-token slope is at most 1.3x the native RoPE model's (same model,
    unpatched; both save O(T)); the attention call alone saves exactly twice as much at twice the length."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 32)
    slopes = {}
    for name in ("native", "rerope"):
        model = make_model("llama").train()
        if name != "native":
            model = patch(model, name, {"window": 16})
        sizes = [
            _saved_bytes(lambda n=n, m=model: m(token_ids(1, n), labels=token_ids(1, n)).loss)
            for n in (256, 512)
        ]
        slopes[name] = (sizes[1] - sizes[0]) / 256
    assert slopes["rerope"] <= 1.3 * slopes["native"], slopes
    alone = [
        _saved_bytes(lambda n=n: attend_neighbour(*_call(n), mask=None, softmax_scale=0.3, block=8))
        for n in (64, 128)
    ]
    assert alone[1] == 2 * alone[0], alone


def test_training_keeps_the_unrotated_queries_and_keys():
    """Given how to make the split from q and k (an encoding's rotations under both maps), a
    training call keeps q, k, v, the output and its log-sum-exp — not the split's four rotated
    tensors (twice q and k) — and makes the split again in backward: values and gradients equal
    autograd through the same split made outside (fp64, 1e-12)."""
    generator = torch.Generator().manual_seed(3)
    length = 40
    angles = torch.rand(length, 4, generator=generator, dtype=torch.float64)
    positions = torch.arange(length).expand(2, length)

    def rotate(x: torch.Tensor, scale: float) -> torch.Tensor:  # a rotation of the halves, by position
        cos, sin = (scale * angles).cos(), (scale * angles).sin()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def split_of(q: torch.Tensor, k: torch.Tensor) -> NeighbourSplit:
        return NeighbourSplit(
            8, rotate(q, 1.0), rotate(k, 1.0), rotate(q, 0.5), rotate(k, 0.0), positions, positions
        )

    base = [torch.randn(2, h, length, 8, generator=generator, dtype=torch.float64) for h in (4, 2, 2)]
    weights = torch.randn(2, length, 4, 8, generator=generator, dtype=torch.float64)
    results = []
    for remade in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        with saved_storages() as kept:
            if remade:
                out = attend_remade(split_of, (q, k), v, mask=None, softmax_scale=0.3, block=8)
            else:
                out = attend_neighbour(split_of(q, k), v, mask=None, softmax_scale=0.3, block=8)
        (out * weights).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad, sum(kept.values())))
    (*got, kept), (*want, _) = results
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    q, k, v = base
    assert kept == (q.numel() + k.numel() + v.numel() + q.numel() + q[..., 0].numel()) * 8


@pytest.fixture
def small_blocks(monkeypatch):
    """Query blocks of 4, so every input spans several."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)


CASES = [
    ("selfextend", {"group_size": 2, "window": 4}),
    ("rerope", {"window": 3}),
    ("leaky_rerope", {"window": 3, "leak": 4.0}),
]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("name", "params"), CASES, ids=[c[0] for c in CASES])
def test_packed_documents_loss_and_gradients_equal_the_eager_backend(small_blocks, name, params):
    """Packed documents (positions restarting per document): loss and every gradient of the
    default backend (neighbour) equal backend="eager" (explicit (T, T) fp32 logits)."""
    batch = packed(documents(([3, 9, 1, 7], [20]), seed=3))
    results = []
    for backend in ("auto", "eager"):
        model = patched(name, params, backend)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss, grads), (eager_loss, eager_grads) = results
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, eager_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_two_forwards_then_one_backward_equal_the_eager_backend(small_blocks):
    """Two training forwards with other position ids (packed documents, then one document of
    the same length), then one backward of both losses: the rotations remade in backward are
    each forward's own, so every gradient equals backend="eager"'s."""
    first = packed(documents(([3, 9, 1, 7], [20]), seed=3))
    length = first["input_ids"].shape[1]
    rows = first["input_ids"].shape[0]
    second = {
        "input_ids": token_ids(rows, length, seed=5),
        "position_ids": torch.arange(length).expand(rows, -1),
    }
    second["labels"] = second["input_ids"]  # (the same shapes as the first: tables keyed by shape)
    results = []
    for backend in ("auto", "eager"):
        model = patched("rerope", {"window": 3}, backend)
        loss = model(**first, use_cache=False).loss + model(**second, use_cache=False).loss
        loss.backward()
        results.append(_grads(model))
    grads, eager_grads = results
    assert grads.keys() == eager_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, eager_grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize(("name", "params"), CASES, ids=[c[0] for c in CASES])
def test_left_padding_logits_and_gradients_equal_the_eager_backend(small_blocks, name, params):
    """A left-padded batch: logits of the real tokens and every gradient of the loss over them
    equal backend="eager"."""
    ids = token_ids(2, 18)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100  # predicted from the last padding position, whose output is not defined
    results = []
    for backend in ("auto", "eager"):
        model = patched(name, params, backend)
        out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), _grads(model)))
    (logits, grads), (eager_logits, eager_grads) = results
    torch.testing.assert_close(logits[0], eager_logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, 5:], eager_logits[1, 5:], atol=1e-5, rtol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, eager_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_bf16_is_no_further_from_fp32_than_the_eager_core():
    """bf16 queries, keys and values (two rows: packed documents, left padding; grouped heads;
    blocks of 8): the backend's output is no further from the fp64 result of the same inputs
    than the eager core's bf16 path (fp32 logits and softmax, bf16 weights times bf16 values),
    on the attended rows."""
    generator = torch.Generator().manual_seed(0)
    length, window = 48, 6

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(2, heads, length, 16, generator=generator).to(torch.bfloat16)

    doc = torch.tensor([[0] * 20 + [1] * 28, [-1] * 7 + [0] * 41])  # -1: left padding
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(28)]), torch.arange(length) - 7])
    allowed = (
        (doc[:, :, None] == doc[:, None, :])
        & (doc[:, None, :] >= 0)
        & torch.ones(length, length).tril().bool()
    )[:, None]
    split = NeighbourSplit(window, rand(4), rand(2), rand(4), rand(2), positions, positions)
    v = rand(2)
    out = attend_neighbour(split, v, mask=allowed, softmax_scale=0.25, block=8)
    assert out.dtype == torch.bfloat16
    expected = reference(split, v, allowed, 0.25)
    near = (positions[:, :, None] - positions[:, None, :] < window)[:, None]

    def fp32_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q.float() @ k.float().repeat_interleave(2, dim=1).transpose(-1, -2)

    logits = torch.where(near, fp32_logits(split.near_q, split.near_k), fp32_logits(split.far_q, split.far_k))
    eager, _ = attend(
        split.near_q,
        split.near_k,
        v,
        mask=allowed,
        bias=None,
        softmax_scale=0.25,
        logits=logits,
        backend="eager",
    )
    rows = allowed.any(dim=-1)[:, 0]  # (B, Tq): queries with a key
    error = (out.double() - expected).abs()[rows].max()
    eager_error = (eager.double() - expected).abs()[rows].max()
    assert error <= eager_error, (error, eager_error)
