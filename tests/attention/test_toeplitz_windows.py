"""Key windows of the Toeplitz path for tables without gradient (``toeplitz_windows.head_plan``, issue
21.6: ALiBi's steep heads). A key whose bias lies more than 2 B + CUTOFF below the bias of
distance 0, with B = scale * max |q_i| * max |k_j|, is left out of the head's blocks. Checked:
the bound itself (every key left out has a weight below 2^-150 times the diagonal key's, exactly
computed in fp64, for any norms and tables), and attention with windows against the
written-out formula (fp64 1e-10, fp32 1e-5; gradients of q, k, v), with adversarial far keys of
large norm that must widen the window, more keys than queries (a cache), and whole patched
models against the eager backend.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references.attention import assert_as_accurate_as_the_formula
from references.attention import toeplitz_attention as reference

from hf_posenc.attention import chunked, toeplitz, toeplitz_windows


def _inputs(seed, batch, heads, rows, q_len, k_len, dim, dtype, norm_spread):
    """q (first ``rows`` of q_len), k, v, dO with per-token norms scaled by 2^U(-spread, spread)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> torch.Tensor:
        x = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
        scales = 2.0 ** (
            (torch.rand(batch, heads, length, 1, generator=generator, dtype=torch.float64) * 2 - 1)
            * norm_spread
        )
        return (x * scales).to(dtype)

    q, k = tokens(q_len)[:, :, :rows], tokens(k_len)
    v = torch.randn(batch, heads, k_len, dim, generator=generator, dtype=dtype)
    grad = torch.randn(batch, heads, rows, dim, generator=generator, dtype=dtype)
    return q, k, v, grad


def _steep_table(heads: int, k_len: int, slopes: list[float], seed: int, dtype) -> torch.Tensor:
    """(H, Tk): -slope_h * d plus a little noise (not monotone: the suffix maximum matters)."""
    generator = torch.Generator().manual_seed(seed)
    distance = torch.arange(k_len, dtype=torch.float64)
    noise = torch.rand(heads, k_len, generator=generator, dtype=torch.float64) * 3
    return (-torch.tensor(slopes[:heads], dtype=torch.float64)[:, None] * distance + noise).to(dtype)


def _plan(q, k, table, q_len, scale):
    rows, k_len = q.shape[2], k.shape[2]
    line = toeplitz.toeplitz_line(table, rows, q_len, k_len, 4, q.dtype)
    return toeplitz_windows.head_plan(q, k, line, rows + k_len - q_len, scale)


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3),
    q_len=st.integers(1, 120),
    extra_keys=st.integers(0, 30),
    dim=st.sampled_from([2, 8]),
    norm_spread=st.floats(0, 6),
    slopes=st.lists(st.floats(0.0, 8.0), min_size=3, max_size=3),
    scale=st.floats(0.05, 2.0),
    seed=st.integers(0, 2**16),
)
def test_every_key_outside_a_window_weighs_below_2_to_the_minus_150(
    heads, q_len, extra_keys, dim, norm_spread, slopes, scale, seed
):
    """For any q, k (per-token norms over 2^±6) and table, each key at a distance >= D_h of its
    query has, in exact fp64 arithmetic, a weight below 2^-150 times the diagonal key's (so below
    2^-150 of the row's sum): leaving it out changes no fp32 softmax. A head marked for the fused
    backward has every exponent s_ij - lse_i of its window at or above -FAST_EXP."""
    k_len = q_len + extra_keys
    q, k, _, _ = _inputs(seed, 1, heads, q_len, q_len, k_len, dim, torch.float32, norm_spread)
    table = _steep_table(heads, k_len, slopes, seed, torch.float32)
    plan = _plan(q, k, table, q_len, scale)
    line = toeplitz.toeplitz_line(table, q_len, q_len, k_len, 4, torch.float32)
    used = line[:, :k_len].flip(1).double()  # the table as the kernel reads it, (H, Tk)
    qd, kd = q.double(), k.double()
    distance = torch.arange(q_len)[:, None] + extra_keys - torch.arange(k_len)[None, :]  # (n, Tk)
    scores = qd @ kd.transpose(-1, -2) * scale + used[:, distance.clamp(min=0)]  # (1, H, n, Tk)
    diagonal = scores.gather(-1, (torch.arange(q_len) + extra_keys).view(1, 1, -1, 1).expand(1, heads, -1, 1))
    causal = distance >= 0
    lse = scores.masked_fill(~causal, -math.inf).logsumexp(dim=-1)  # (1, H, n)
    for head, window in enumerate(plan.windows):
        outside = distance >= window  # (n, Tk), causal only (window >= 1)
        if outside.any():
            gap = (scores[0, head] - diagonal[0, head])[outside]
            assert float(gap.max()) < -150 * math.log(2), (head, window, float(gap.max()))
        if plan.fused[head]:  # every exponent of the head's window on aten's fast exp path
            inside = causal & ~outside
            exponents = (scores[0, head] - lse[0, head][:, None])[inside]
            assert float(exponents.min()) >= -toeplitz_windows.FAST_EXP, (head, float(exponents.min()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    q_len=st.integers(1, 100),
    rows_cut=st.integers(0, 20),
    extra_keys=st.integers(0, 20),
    block=st.sampled_from([1, 8, 16, 256]),
    backward_block=st.sampled_from([1, 8, 128]),
    key_align=st.sampled_from([1, 8, 64]),
    norm_spread=st.floats(0, 4),
    slopes=st.lists(st.sampled_from([0.0, 0.05, 1.0, 4.0, 16.0]), min_size=3, max_size=3),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_windowed_attention_equals_the_written_out_formula(
    batch,
    heads,
    q_len,
    rows_cut,
    extra_keys,
    block,
    backward_block,
    key_align,
    norm_spread,
    slopes,
    dtype,
    seed,
    monkeypatch,
):
    """A steep table without gradient (windows narrower than the keys) for any block sizes, key
    alignment, the first n <= Tq queries and more keys than queries (a cache): output and the
    gradients of q, k, v equal autograd through the formula over every key (fp64 1e-10 with
    per-token norms over 2^±4, fp32 1e-5 over 2^±1)."""
    monkeypatch.setattr(toeplitz, "BACKWARD_BLOCK", backward_block)
    monkeypatch.setattr(toeplitz_windows, "KEY_ALIGN", key_align)
    rows = max(1, q_len - rows_cut)
    k_len = q_len + extra_keys
    # fp32: norms within 2^±1 (scores of hundreds carry fp32 rounding above 1e-5 in any formula)
    spread = norm_spread if dtype == torch.float64 else norm_spread / 4
    q, k, v, grad = _inputs(seed, batch, heads, rows, q_len, k_len, 4, dtype, spread)
    table = _steep_table(heads, k_len, slopes, seed, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = toeplitz.attend_toeplitz(*leaves, table, q_len, 0.5, block)
    got = torch.autograd.grad((out * grad).sum(), leaves)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*exact, table.double(), q_len, 0.5)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), exact)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), want.detach(), atol=tolerance, rtol=tolerance)
    for g, w in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, atol=tolerance, rtol=tolerance)


def test_steep_heads_get_narrow_windows_and_a_far_key_of_large_norm_widens_them(monkeypatch):
    """ALiBi-like slopes 1, 1/8, 1/64 over 400 keys with unit-sized q, k: the steepest head's
    window is far shorter than the keys, the gentlest takes every key, and the forward's kernel
    calls of that head read fewer keys. Then key 0 and every query aligned and scaled so that key 0,
    399 distances away, outweighs the diagonal (scale * |q| |k| = 600 > 399): the window covers it
    and the output equals the formula (which it would not with the narrow window)."""
    length, dim, scale = 400, 4, 0.5
    table = _steep_table(3, length, [1.0, 1 / 8, 1 / 64], 0, torch.float64)
    q, k, v, grad = _inputs(1, 1, 3, length, length, length, dim, torch.float64, 0.0)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    plan = _plan(q, k, table, length, scale)
    assert plan.windows[0] < 150 and plan.windows[2] == length, plan.windows
    seen = []
    original = toeplitz._fused
    monkeypatch.setattr(
        toeplitz, "_fused", lambda q, k, *a: seen.append((q.shape[1], k.shape[2])) or original(q, k, *a)
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = toeplitz.attend_toeplitz(*leaves, table, length, scale, 64)
    assert min(keys for _, keys in seen) < length // 2, seen
    torch.testing.assert_close(out, reference(q, k, v, table, length, scale), atol=1e-10, rtol=1e-10)

    aligned_q = torch.zeros_like(q)
    aligned_q[..., 0] = math.sqrt(600 / scale)
    aligned_k = k.clone()
    aligned_k[:, :, 0] = 0.0
    aligned_k[:, :, 0, 0] = math.sqrt(600 / scale)
    plan = _plan(aligned_q, aligned_k, table, length, scale)
    assert plan.windows == [length] * 3, plan.windows
    leaves = [t.clone().requires_grad_() for t in (aligned_q, aligned_k, v)]
    out = toeplitz.attend_toeplitz(*leaves, table, length, scale, 64)
    want = reference(aligned_q, aligned_k, v, table, length, scale)
    assert float((want[0, 0, -1] - v[0, 0, 0]).abs().max()) < 1e-6  # key 0 dominates the last row
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    got = torch.autograd.grad((out * grad).sum(), leaves)
    exact = [t.detach().clone().requires_grad_() for t in (aligned_q, aligned_k, v)]
    want_grads = torch.autograd.grad((reference(*exact, table, length, scale) * grad).sum(), exact)
    for g, w in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


def test_a_table_with_nan_or_inf_keeps_every_key():
    """No window where the bound cannot be trusted: a NaN or -inf in a head's table."""
    length = 50
    table = _steep_table(2, length, [4.0, 4.0], 0, torch.float32)
    table[0, 30] = float("nan")
    table[1, 40] = float("-inf")
    q, k, _, _ = _inputs(0, 1, 2, length, length, length, 4, torch.float32, 0.0)
    assert _plan(q, k, table, length, 0.5).windows == [length, length]


def test_patched_alibi_models_with_windows_train_and_decode_like_eager(monkeypatch):
    """A 16-head ALiBi model (slopes 2^-0.5 .. 2^-8) over 300 tokens, batch 2, on the chunked
    backend, where the steepest heads' windows are shorter than the sequence: logits and every
    parameter's gradient equal the eager backend's (fp32, 1e-5); then a greedy generate() with
    the KV cache gives the same tokens and final logits."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 64)
    windows = []
    original = toeplitz.head_plan
    monkeypatch.setattr(
        toeplitz, "head_plan", lambda *a: windows.append(original(*a).windows) or original(*a)
    )
    ids = token_ids(2, 300)
    results = {}
    for backend in ("chunked", "eager"):
        model = make_model("llama", hidden_size=64, num_attention_heads=16, num_key_value_heads=16)
        model = patch(model, "alibi", backend=backend).train()
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.eval()
        with torch.no_grad():
            generated = model.generate(ids[:1, :280], max_new_tokens=4, do_sample=False)
            final = model(generated).logits
        results[backend] = (out.logits.detach(), grads, generated, final)
    assert windows and min(min(w) for w in windows) < 300, windows
    chunk, eager = results["chunked"], results["eager"]
    torch.testing.assert_close(chunk[0], eager[0], atol=1e-5, rtol=1e-5)
    for n, g in eager[1].items():
        torch.testing.assert_close(chunk[1][n], g, atol=1e-5, rtol=1e-5, msg=n)
    assert torch.equal(chunk[2], eager[2])
    torch.testing.assert_close(chunk[3], eager[3], atol=1e-5, rtol=1e-5)


def test_inference_windows_equal_the_formula_and_a_gentle_table_keeps_every_key():
    """Without gradients (inference): a steep table's windows still leave out keys and the output
    equals the formula (fp64 1e-10); a table within CUTOFF of its distance-0 bias everywhere keeps
    every key whatever the norms (the plan skips them)."""
    length, scale = 300, 0.5
    steep = _steep_table(2, length, [2.0, 0.01], 4, torch.float64)
    q, k, v, _ = _inputs(4, 2, 2, length, length, length, 4, torch.float64, 1.0)
    with torch.no_grad():
        out = toeplitz.attend_toeplitz(q, k, v, steep, length, scale, 64)
    torch.testing.assert_close(out, reference(q, k, v, steep, length, scale), atol=1e-10, rtol=1e-10)
    line = toeplitz.toeplitz_line(steep, length, length, length, 4, q.dtype)
    assert toeplitz_windows.head_plan(q, k, line, length, scale, backward=False).windows[0] < length
    gentle = _steep_table(2, length, [0.3, 0.01], 4, torch.float64)  # drops at most 90 + 3 < CUTOFF
    line = toeplitz.toeplitz_line(gentle, length, length, length, 4, q.dtype)
    assert toeplitz_windows.head_plan(q * 1e3, k, line, length, scale, backward=False).windows == [
        length,
        length,
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_windows_are_no_further_from_fp64_than_the_eager_formula(dtype):
    """A steep frozen table in bf16/fp16 (windows and the per-head backward choice): output and the
    gradients of q, k, v are no further from the fp64 formula than the written-out formula
    evaluated in the same dtype (plus a rounding step of it)."""
    length, scale = 200, 0.5
    table = _steep_table(3, length, [2.0, 0.25, 0.01], 5, torch.float32)
    q, k, v, grad = _inputs(5, 2, 3, length, length, length, 8, torch.float32, 0.5)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference(*exact, table.double(), length, scale)
    want_grads = torch.autograd.grad((want * grad.double()).sum(), exact)
    runs = {}
    for name in ("ours", "formula"):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if name == "ours":
            out = toeplitz.attend_toeplitz(*leaves, table.to(dtype), length, scale, 64)
        else:
            out = reference(*leaves, table.to(dtype), length, scale)
        runs[name] = (out, *torch.autograd.grad((out * grad.to(dtype)).sum(), leaves))
    assert_as_accurate_as_the_formula(runs, (want, *want_grads), dtype)
