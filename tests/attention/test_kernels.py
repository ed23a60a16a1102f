"""The kernel backends that serve only on CUDA with an optional package (flash-attn's ALiBi,
flash-linear-attention's forgetting and stick-breaking attention), each checked here with a
stand-in for the kernel written from the package's documented semantics: the layout, causal
alignment and arguments hf_posenc passes equal the chunked core or the eager attention, and a
call the kernel cannot serve (padding, a cache, gradients) is declined. On a GPU the real kernels
run in tests/attention/test_backends.py's ``test_cuda_auto_backend_equals_eager``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, patch

import hf_posenc.attention.chunked as chunked
from hf_posenc.attention.chunked import attend_chunked
from hf_posenc.attention.kernels import attend_flash_alibi
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.block_bias import CumulativeBias, LinearDistanceBias, SeparableBias

ATOL = 1e-5


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)


def test_flash_alibi_path_passes_bthd_layout_causal_and_the_slopes():
    """With a stand-in for flash_attn_func written from flash-attn's documented semantics
    (bias -slope * |i - j|, bottom-right causal), the ALiBi path equals the reference."""
    calls = []

    def flash_reference(q, k, v, dropout_p, softmax_scale, causal, alibi_slopes):  # (B, T, H, D)
        calls.append((causal, alibi_slopes))
        q_len, k_len = q.shape[1], k.shape[1]
        i = torch.arange(k_len - q_len, k_len)[:, None]
        j = torch.arange(k_len)[None, :]
        bias = -alibi_slopes[:, None, None] * (i - j).abs()
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * softmax_scale + bias
        scores = scores.masked_fill(j > i, -math.inf)
        return (torch.softmax(scores, -1) @ v.transpose(1, 2)).transpose(1, 2)

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=generator)
    k, v = (torch.randn(1, 4, 9, 8, generator=generator) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    bias = LinearDistanceBias(5, 9, slopes)
    out = attend_flash_alibi(
        q, k, v, bias=bias, mask=None, softmax_scale=0.35, flash_function=flash_reference
    )
    expected = attend_chunked(q, k, v, bias=bias, mask=None, softmax_scale=0.35)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert calls[0][0] is True
    assert (
        attend_flash_alibi(
            q,
            k,
            v,
            bias=bias,
            mask=torch.ones(1, 1, 5, 9, dtype=torch.bool),
            softmax_scale=0.35,
            flash_function=flash_reference,
        )
        is None
    )  # padding: not served


def test_fla_forgetting_path_passes_bthd_layout_and_log_gates():
    """With a stand-in for fla's parallel_forgetting_attn written from its documented semantics
    (g: per-token log forget gates, bias sum_{l=j+1}^{i} g_l, causal), FoX's path equals chunked;
    with a cache (Tq != Tk) or padding it declines."""
    from hf_posenc.attention.kernels import attend_fla_forgetting

    def forgetting_reference(q, k, v, g, scale):  # (B, T, H, D), g (B, T, H)
        c = g.float().cumsum(1).transpose(1, 2)  # (B, H, T)
        scores = (
            q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * scale
            + c[..., :, None]
            - c[..., None, :]
        )
        t = q.shape[1]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
        return (torch.softmax(scores, -1) @ v.transpose(1, 2)).transpose(1, 2)

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 11, 8, generator=generator) for _ in range(3))
    log_f = torch.nn.functional.logsigmoid(torch.randn(2, 4, 11, generator=generator) + 2)
    c = log_f.double().cumsum(-1).float()
    bias = CumulativeBias(log_f, c)
    out = attend_fla_forgetting(q, k, v, bias=bias, mask=None, softmax_scale=0.3, kernel=forgetting_reference)
    torch.testing.assert_close(
        out, attend_chunked(q, k, v, bias=bias, mask=None, softmax_scale=0.3), atol=ATOL, rtol=0
    )
    cached = SeparableBias(3, 11, c[..., -3:], c)
    assert (
        attend_fla_forgetting(
            q[:, :, -3:], k, v, bias=cached, mask=None, softmax_scale=0.3, kernel=forgetting_reference
        )
        is None
    )
    padded = torch.ones(2, 1, 11, 11, dtype=torch.bool)
    assert (
        attend_fla_forgetting(q, k, v, bias=bias, mask=padded, softmax_scale=0.3, kernel=forgetting_reference)
        is None
    )


@pytest.mark.parametrize("params", [{}, {"attend_current": True, "remainder": "drop"}, {"remainder": "drop"}])
def test_fla_stickbreaking_path_equals_the_eager_sba(params):
    """With a stand-in for fla's parallel_stickbreaking_attn written from its documented
    semantics (A_ij = sigmoid(z_ij) prod_{j<l<i (or <= i)} (1 - sigmoid(z_il)), o = sum_j A_ij v_j,
    rem = 1 - sum_j A_ij), sba's fused path equals its eager attention, GQA included."""
    from hf_posenc.attention.core import attend
    from hf_posenc.attention.kernels import attend_fla_stickbreaking

    def stickbreaking_reference(q, k, v, scale, attend_current):  # (B, T, H, D)
        groups = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(groups, dim=2).transpose(1, 2).double() for x in (k, v))
        z = q.transpose(1, 2).double() @ k.transpose(-1, -2) * scale  # (B, H, T, T)
        t = z.shape[-1]
        visible = torch.ones(t, t, dtype=torch.bool).tril(0 if attend_current else -1)
        weights = torch.zeros_like(z)
        for i in range(t):
            keep = 1.0
            for j in reversed(range(t)):
                if visible[i, j]:
                    weights[..., i, j] = torch.sigmoid(z[..., i, j]) * keep
                    keep = keep * (1 - torch.sigmoid(z[..., i, j]))
        o = (weights @ v).transpose(1, 2).float()
        return o, (1 - weights.sum(-1)).transpose(1, 2).float()

    model = patch(make_model("llama", num_kv_heads=2), "sba", params)
    sba = model.posenc
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=generator)
    k, v = (torch.randn(2, 2, 9, 8, generator=generator) for _ in range(2))
    ctx = probe_call(sba.geometry, 9)
    with torch.no_grad():
        fused = attend_fla_stickbreaking(
            q,
            k,
            v,
            mask=None,
            softmax_scale=0.4,
            kernel=stickbreaking_reference,
            attend_current=sba.config.attend_current,
            remainder=sba.config.remainder,
        )
        eager, _ = attend(
            q,
            k,
            v,
            mask=None,
            bias=None,
            softmax_scale=0.4,
            backend="eager",
            normalize=lambda scores, allowed: sba.normalize(ctx.with_allowed(allowed), scores),
        )
    torch.testing.assert_close(fused, eager, atol=ATOL, rtol=0)
    assert (
        attend_fla_stickbreaking(
            q,
            k,
            v,
            mask=None,
            softmax_scale=0.4,
            kernel=stickbreaking_reference,
            attend_current=False,
            remainder="drop",
        )
        is None
    )  # gradients recorded here: not served


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fla_forgetting_serves_half_precision_only(monkeypatch, dtype):
    """fla's kernels run fp32 dots in TF32 (on an H200, FoX's fp32 logits, gradients and cached
    decoding through it left eager's 1e-4): an fp32 call is left to FlexAttention / chunked."""
    import types

    import hf_posenc.attention.kernels as kernels

    monkeypatch.setattr(kernels, "fla_available", lambda: True)
    c = torch.zeros(1, 2, 8)
    call = types.SimpleNamespace(
        explicit=False,
        want_weights=False,
        mask=None,
        on_cuda=True,
        bias=CumulativeBias(c, c),
        q=torch.zeros(1, 2, 8, 4, dtype=dtype),
        dropout_p=0.0,
    )
    assert kernels.FlaForgettingBackend().serves(call) == (dtype != torch.float32)
