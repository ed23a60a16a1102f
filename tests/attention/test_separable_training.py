"""FoX's separable bias u_i - w_j in training on the chunked backend (hf_posenc/attention/separable.py,
issue 21.6): each query block is SDPA's fused CPU kernel with the bias as one more feature of q and
k, and backward is that kernel's own backward per block from the kept output and log-sum-exp
(no block recomputed). Checked against autograd of softmax(q k^T s + u_i - w_j, masked) v written
out in fp64 here, for the fused path and the recomputing one (other devices, dropout), and that
the fused path is the one a CPU training call takes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.attention import separable
from hf_posenc.attention.chunked import attend_chunked
from hf_posenc.encodings.block_bias import SeparableBias


def _reference(q, k, v, query_term, key_term, allowed, scale):
    """fp64 softmax(q k^T * scale + u_i - w_j) v over the allowed keys, GQA by repetition -> (B, Tq, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale + query_term[..., :, None] - key_term[..., None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(17, 40),  # past FEW_QUERIES: the separable path
    extra_keys=st.integers(0, 6),
    block=st.integers(1, 8),
    heads=st.sampled_from([(2, 2), (4, 2), (2, 1)]),
    padding=st.integers(0, 3),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_separable_training_gradients_equal_autograd_of_the_formula(
    q_len, extra_keys, block, heads, padding, fused, seed
):
    """Output and the gradients of q, k, v, the query terms u and the key terms w (independent
    tensors, as FoX with cached keys gives them) equal fp64 autograd of the written-out formula
    (fp32, 1e-5), for any shape, block size, GQA ratio and left padding of row 1, through the
    fused CPU kernel's backward (``fused``) or the recomputing path."""
    generator = torch.Generator().manual_seed(seed)
    k_len = q_len + extra_keys
    hq, hkv = heads
    q = torch.randn(2, hq, q_len, 8, generator=generator)
    k = torch.randn(2, hkv, k_len, 8, generator=generator)
    v = torch.randn(2, hkv, k_len, 8, generator=generator)
    key_term = torch.randn(2, hq, k_len, generator=generator).cumsum(-1)
    query_term = key_term[..., -q_len:] + 0.3 * torch.randn(2, hq, q_len, generator=generator)
    rows = torch.arange(k_len - q_len, k_len)[:, None]
    allowed = (torch.arange(k_len)[None, :] <= rows)[None, None].expand(2, 1, q_len, k_len).clone()
    allowed[1, :, :, : min(padding, k_len - 1)] = False
    allowed[1, :, :, k_len - q_len :] |= torch.eye(q_len, dtype=torch.bool)  # padded queries see themselves
    mask = allowed if padding else None
    grad = torch.randn(2, q_len, hq, 8, generator=generator)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, query_term, key_term)]
    lq, lk, lv, lu, lw = leaves
    with pytest.MonkeyPatch.context() as patched:
        if not fused:  # as off CPU: every block recomputed in backward
            patched.setattr(separable, "_CPU_BACKWARD", None)
        out = attend_chunked(
            lq, lk, lv, bias=SeparableBias(q_len, k_len, lu, lw), mask=mask, softmax_scale=0.3, block=block
        )
        (out * grad).sum().backward()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, query_term, key_term)]
    want = _reference(*leaves64, allowed, 0.3)
    (want * grad.double()).sum().backward()
    torch.testing.assert_close(out.double(), want.detach(), atol=1e-5, rtol=0)
    for name, got, ref in zip("qkvuw", leaves, leaves64, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_cpu_training_takes_the_fused_backward_and_no_checkpoint(monkeypatch):
    """A training call on CPU runs the fused kernel's forward once and its backward once (through
    the kernel pair, ``separable._forward`` / ``_backward``) and never activation checkpointing
    (which ran every block's forward twice)."""
    calls = {"forward": 0, "backward": 0, "checkpoint": 0}
    forward, backward, recompute = separable._forward, separable._backward, separable.checkpoint

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(separable, "_forward", counting("forward", forward))
    monkeypatch.setattr(separable, "_backward", counting("backward", backward))
    monkeypatch.setattr(separable, "checkpoint", counting("checkpoint", recompute))
    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    terms = torch.randn(1, 2, 64).cumsum(-1).requires_grad_()
    out = attend_chunked(
        q, k, v, bias=SeparableBias(64, 64, terms, terms), mask=None, softmax_scale=0.3, block=16
    )
    out.sum().backward()
    assert calls == {"forward": 1, "backward": 1, "checkpoint": 0}
    assert terms.grad is not None and torch.isfinite(terms.grad).all()


def test_a_second_derivative_through_the_fused_path_is_refused():
    """The fused kernel's backward has no derivative of its own: differentiating its gradients
    again raises (``once_differentiable``) instead of giving a second derivative that silently
    misses the kernel's part."""
    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    terms = torch.randn(1, 2, 32).cumsum(-1).requires_grad_()
    out = attend_chunked(q, k, v, bias=SeparableBias(32, 32, terms, terms), mask=None, softmax_scale=0.3)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="twice|double|differentiable"):
        grad_q.sum().backward()


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "padding-mask"])
def test_fused_separable_training_keeps_what_native_sdpa_keeps(mask):
    """What the fused path keeps for backward is q, k, v, the bias terms, the output and one
    log-sum-exp per query: (3 + 1) T D + 3 T values per head (plus the mask given), the
    O(T) of native SDPA, no (D + 1)-wide copies of the keys and values and nothing per block."""
    length, heads, dim = 256, 2, 8
    q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
    terms = torch.randn(1, heads, length).cumsum(-1).requires_grad_()
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None] if mask else None
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = attend_chunked(
            q,
            k,
            v,
            bias=SeparableBias(length, length, terms, terms),
            mask=causal,
            softmax_scale=0.3,
            block=16,
        )
    out.sum().backward()
    values = heads * length * (4 * dim + 3)
    assert sum(storages.values()) <= values * 4 + (causal.numel() if mask else 0) + 4096
