"""The chunked backend's Toeplitz path (``attention/toeplitz.py``, issue 21.6): causal attention
with a bias ``table[h, i - j]`` over the queries in reverse order, the fused kernel forward and a
backward that recomputes each block's weights from the kept log-sum-exp and sums dS along
anti-diagonals in place. Checked against softmax(q k^T s + table[h, i - j], causal) v written
out independently, in fp64 (1e-10) and fp32 (1e-5), gradients of q, k, v and the table included,
for any block sizes, query/key counts (bottom-right aligned), batch and heads; and through whole
patched models (GQA, batch > 1) against the eager backend.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references.attention import assert_as_accurate_as_the_formula
from references.attention import toeplitz_attention as reference

from hf_posenc.attention import chunked, toeplitz, toeplitz_backward


def _case(seed, batch, heads, rows, q_len, k_len, dim, dtype, table_scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=generator, dtype=dtype)[:, :, :rows]
    k, v = (torch.randn(batch, heads, k_len, dim, generator=generator, dtype=dtype) for _ in range(2))
    table = torch.randn(heads, k_len, generator=generator, dtype=dtype) * table_scale
    grad = torch.randn(batch, heads, rows, dim, generator=generator, dtype=dtype)
    return q, k, v, table, grad


def _check(q, k, v, table, grad, q_len, block, tolerance, table_grad=True):
    leaves = [t.clone().requires_grad_(n < 3 or table_grad) for n, t in enumerate((q, k, v, table))]
    out = toeplitz.attend_toeplitz(*leaves[:3], leaves[3], q_len, 0.7, block)
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad((out * grad).sum(), wanted)
    ref_leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    want = reference(*ref_leaves[:3], ref_leaves[3], q_len, 0.7)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), [t for t in ref_leaves if t.requires_grad])
    torch.testing.assert_close(out.double(), want.detach(), atol=tolerance, rtol=tolerance)
    for g, w in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, atol=tolerance, rtol=tolerance)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    q_len=st.integers(1, 40),
    rows_cut=st.integers(0, 20),
    extra_keys=st.integers(0, 9),
    block=st.sampled_from([1, 4, 8, 16, 256]),
    backward_block=st.sampled_from([1, 3, 8, 128]),
    explicit_heads=st.sampled_from([1, 2, 8]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    table_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_toeplitz_attention_and_gradients_equal_the_written_out_formula(
    batch,
    heads,
    q_len,
    rows_cut,
    extra_keys,
    block,
    backward_block,
    explicit_heads,
    dtype,
    table_grad,
    seed,
    monkeypatch,
):
    """Output and the gradients of q, k, v and the table equal autograd through the written-out
    formula (fp64 within 1e-10, fp32 within 1e-5) for any forward and backward block sizes, the
    first n <= Tq queries (FIRE's rows below its threshold) and more keys than queries (a cache);
    a table without gradient (ALiBi, Sandwich, frozen) takes torch's fused backward instead, or
    the explicit one per head window, any number of windowed heads per call (a learned table's
    explicit backward takes all heads at once)."""
    monkeypatch.setattr(toeplitz, "BACKWARD_BLOCK", backward_block)
    monkeypatch.setattr(toeplitz_backward, "EXPLICIT_HEADS", explicit_heads)
    rows = max(1, q_len - rows_cut)
    q, k, v, table, grad = _case(seed, batch, heads, rows, q_len, q_len + extra_keys, 4, dtype)
    _check(q, k, v, table, grad, q_len, block, 1e-10 if dtype == torch.float64 else 1e-5, table_grad)


@pytest.mark.parametrize("q_len", [255, 256, 257, 300])
def test_block_edges_and_a_frozen_table(q_len, monkeypatch):
    """Around the default blocks' edges (256 forward, 128 backward) in fp32; a table without
    gradient (ALiBi, Sandwich, frozen) gets none and q, k, v theirs from torch's fused backward."""
    q, k, v, table, grad = _case(q_len, 1, 2, q_len, q_len, q_len, 8, torch.float32)
    calls = []
    for name in ("fused_gradients", "toeplitz_gradients"):
        original = getattr(toeplitz, name)
        monkeypatch.setattr(toeplitz, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    _check(q, k, v, table, grad, q_len, 256, 1e-5)
    _check(q, k, v, table, grad, q_len, 256, 1e-5, table_grad=False)
    assert calls == ["toeplitz_gradients", "fused_gradients"], calls


def test_a_steep_fixed_table_takes_the_explicit_backward(monkeypatch):
    """Per head of a table without gradient: a head whose exponents may leave aten's fast exp
    (spread of its window + 2 B + log K above FAST_EXP: ALiBi's steep heads) goes to the explicit
    backward (it flushes tiny weights), a gentle one to the fused backward; both equal the
    formula (fp32, 1e-5)."""
    calls = []
    for name in ("fused_gradients", "toeplitz_gradients"):
        original = getattr(toeplitz, name)
        monkeypatch.setattr(toeplitz, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    q_len = 80
    q, k, v, _, grad = _case(7, 2, 2, q_len, q_len, q_len, 4, torch.float32)
    steep = -torch.arange(q_len, dtype=torch.float32).repeat(2, 1) * torch.tensor([[0.5], [0.01]])
    _check(q, k, v, steep, grad, q_len, 16, 1e-5, table_grad=False)  # spans 39.5: both heads fused
    # head 0 spans 158 (explicit), head 1 3.2 (fused)
    _check(q, k, v, steep * 4, grad, q_len, 16, 1e-5, table_grad=False)
    assert calls == ["fused_gradients", "toeplitz_gradients", "fused_gradients"], calls


def test_weights_far_below_one_are_flushed_without_changing_the_result():
    """A bias that sends most weights below 2^-100 (and many into fp32's subnormal range): the
    recomputed weights under 2^FLUSH are exact zeros (the fast path), and every gradient still
    equals the formula's within fp32 1e-5."""
    q_len = 64
    q, k, v, table, grad = _case(3, 1, 2, q_len, q_len, q_len, 4, torch.float32)
    table = -torch.arange(q_len, dtype=torch.float32).repeat(2, 1) * 3.0  # weight ~ e^(-3 d)
    _check(q, k, v, table, grad, q_len, 16, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_no_further_from_fp64_than_the_eager_formula_in_it(dtype):
    """bf16/fp16 inputs (the backward computes in fp32): output and gradients are no further
    from the fp64 formula than the written-out formula evaluated in the same dtype (plus a
    rounding step of it)."""
    q_len = 70
    q, k, v, table, grad = _case(11, 2, 2, q_len, q_len, q_len, 8, torch.float32)
    exact = [t.double().requires_grad_() for t in (q, k, v, table)]
    want = reference(*exact[:3], exact[3], q_len, 0.7)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), exact)
    runs = {}
    for name in ("ours", "formula"):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table)]
        run = toeplitz.attend_toeplitz if name == "ours" else reference
        out = run(*leaves[:3], leaves[3], q_len, 0.7, *([16] if name == "ours" else []))
        runs[name] = (out, *torch.autograd.grad((out * grad.to(dtype)).sum(), leaves))
    assert_as_accurate_as_the_formula(runs, (want, *want_grads), dtype)


def test_the_sdpa_path_for_dropout_and_compilation_equals_the_formula(monkeypatch):
    """With dropout (or under torch.compile) each block is one SDPA call on the same Hankel views,
    gradients through SDPA and ToeplitzView's anti-diagonal sums: equal to the formula at p = 0."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = []
    original = toeplitz.ToeplitzView.apply

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(toeplitz.ToeplitzView, "apply", counting)
    q, k, v, table, grad = _case(5, 2, 3, 30, 37, 41, 4, torch.float64)
    _check(q, k, v, table, grad, 37, 8, 1e-10)
    assert calls, "the SDPA path was not taken"


def test_backward_keeps_only_linear_state():
    """What ToeplitzAttention keeps for backward grows linearly with the length: q, k, v, the
    output, the log-sum-exp and the line (at 4x the length, at most 4x)."""

    def saved_bytes(length: int) -> int:
        q, k, v, table, _ = _case(0, 1, 2, length, length, length, 8, torch.float32)
        leaves = [t.requires_grad_() for t in (q, k, v, table)]
        saved: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = toeplitz.attend_toeplitz(*leaves[:3], leaves[3], length, 0.5, 16)
        out.sum().backward()
        return sum(saved)

    short, long = saved_bytes(64), saved_bytes(256)
    assert long <= 4 * short + 4096, (short, long)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["kerple", "t5", "sandwich", "alibi"])
def test_patched_models_train_like_eager(name, kv_heads, monkeypatch):
    """Whole models (batch 2, 37 tokens: blocks of 8 forward and 3 backward, a short last block)
    on the chunked backend: logits and every parameter's gradient equal the eager backend's
    (fp32, 1e-5), with grouped keys too; learned tables (kerple, t5) through the explicit
    backward, fixed ones (sandwich, alibi) through the fused one."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 8)
    monkeypatch.setattr(toeplitz, "BACKWARD_BLOCK", 3)
    calls = []
    original = toeplitz.ToeplitzAttention.apply
    monkeypatch.setattr(toeplitz.ToeplitzAttention, "apply", lambda *args: calls.append(1) or original(*args))
    ids = token_ids(2, 37)
    results = {}
    for backend in ("chunked", "eager"):
        model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads)
        model = patch(model, name, backend=backend).train()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[backend] = (out.logits.detach(), grads)
    assert calls, "the chunked backend did not take its Toeplitz path"
    torch.testing.assert_close(results["chunked"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    assert results["chunked"][1].keys() == results["eager"][1].keys()
    for n, g in results["eager"][1].items():
        torch.testing.assert_close(results["chunked"][1][n], g, atol=1e-5, rtol=1e-5, msg=n)
