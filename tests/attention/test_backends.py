"""Every attention backend gives the eager reference's outputs and gradients.

The chunked backend (query blocks over SDPA, Toeplitz biases as strided views) and the
FlexAttention backend (uncompiled off CUDA) are checked against ``backend="eager"`` (explicit
fp32 scores) at fp32 atol 1e-5, and the block core against an fp64 softmax written here.
Blocks are made tiny (3..5 queries) so every input spans several of them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
import hf_posenc.attention.chunked as chunked
from hf_posenc.attention.chunked import attend_chunked
from hf_posenc.attention.flex import attend_flex
from hf_posenc.attention.kernels import attend_flash_alibi
from hf_posenc.core.registry import get_encoding
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.block_bias import (
    CumulativeBias,
    DistanceBias,
    LinearDistanceBias,
    RowBias,
    SeparableBias,
)

ATOL = 1e-5
#: encodings with a score bias, with parameters that exercise their variants
BLOCK_CASES = [
    ("alibi", {}),
    ("t5", {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}),
    ("kerple", {}),
    ("kerple", {"variant": "power"}),
    ("sandwich", {"dim": 16}),
    ("fire", {"init_L": 6.0}),  # L below the inputs' lengths: the non-Toeplitz rows are exercised
    ("fox", {}),
    ("fox_pro", {}),
]
BLOCK_IDS = [
    name + ("-" + "-".join(f"{k}={v}" for k, v in p.items()) if p else "") for name, p in BLOCK_CASES
]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)


def test_block_cases_cover_every_encoding_with_a_score_bias():
    with_bias = {info.name for info in hf_posenc.list_encodings() if "score_bias" in info.stages}
    assert with_bias == {name for name, _ in BLOCK_CASES}


def _models(family: str, name: str, params: dict, backends: tuple[str, ...]):
    models = {backend: patch(make_model(family), name, params, backend=backend) for backend in backends}
    state = models["eager"].posenc.state_dict()
    for model in models.values():
        model.posenc.load_state_dict(state)
    return models


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
# flex on CPU (uncompiled FlexAttention) is seconds per case: slow here; the quick run keeps
# test_flex_serves_every_block_encoding_without_falling_back
@pytest.mark.parametrize("backend", ["chunked", pytest.param("flex", marks=pytest.mark.slow), "auto"])
def test_block_backend_logits_equal_eager_with_and_without_left_padding(family, case, backend):
    """One forward of 2 x 17 tokens (row 1 left-padded by 4; Mistral's window is 8)."""
    name, params = case
    models = _models(family, name, params, ("eager", backend))
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        reference = models["eager"](ids).logits
        padded_reference = models["eager"](ids, attention_mask=mask).logits
        logits = models[backend](ids).logits
        padded = models[backend](ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[0], padded_reference[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[1, 4:], padded_reference[1, 4:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_decoding_with_a_cache_equals_the_eager_full_forward(family, case):
    """Prefill 11 tokens (3 blocks) then 3 single-token steps and one 4-token step."""
    from transformers import DynamicCache

    name, params = case
    models = _models(family, name, params, ("eager", "chunked"))
    ids = token_ids(1, 18)
    with torch.no_grad():
        full = models["eager"](ids).logits
        model = models["chunked"]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :11], past_key_values=cache, use_cache=True).logits]
        for start, stop in [(11, 12), (12, 13), (13, 14), (14, 18)]:
            steps.append(model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_chunked_gradients_equal_eager_gradients(family, case):
    """Loss gradients of every parameter (model and encoding) match, so training is the same;
    the padded rows go through the per-block path with recomputation in backward. ``flex``
    off CUDA (no FlexAttention backward there) trains through ``chunked`` and matches too."""
    name, params = case
    models = _models(family, name, params, ("eager", "chunked", "flex"))
    ids = token_ids(2, 13)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    grads = {}
    for backend, model in models.items():
        model.train()
        for attention_mask in (None, mask):
            model.zero_grad()
            labels = ids.clone()
            if attention_mask is not None:
                labels[1, :3] = -100  # the first real token is predicted from a padded position
            model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
            grads[backend, attention_mask is None] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
    for plain, backend in [(True, "chunked"), (False, "chunked"), (True, "flex"), (False, "flex")]:
        eager, blocks = grads["eager", plain], grads[backend, plain]
        assert eager.keys() == blocks.keys()
        assert any(n.startswith("posenc.") for n in eager) == bool(list(models["eager"].posenc.parameters()))
        for n in eager:
            torch.testing.assert_close(blocks[n], eager[n], atol=ATOL, rtol=1e-4, msg=n)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
def test_every_view_of_a_score_bias_is_its_full_matrix_on_attendable_entries(case):
    """What the backends read of one score bias agree: any block of ``rows`` (chunked) and the
    per-score ``elementwise`` bias (FlexAttention) equal ``full()`` (sdpa/eager) wherever a query
    may attend, for a square call and for the last queries of a longer key range (decoding).
    (``full()`` itself is checked against each encoding's formula in its own tests.)"""
    name, params = case
    model = patch(make_model("llama"), name, params)
    geometry = model.posenc.geometry
    shapes = [(9, 9)] if get_encoding(name).stateful else [(9, 9), (3, 9), (1, 9)]  # stateful: no cache here
    for q_len, k_len in shapes:
        ctx = probe_call(geometry, q_len, k_len)
        hidden = torch.randn(ctx.hidden.shape, generator=torch.Generator().manual_seed(q_len))
        with torch.no_grad():
            bias = model.posenc.score_bias(dataclasses.replace(ctx, hidden=hidden))
            full = bias.full()  # (B|1, Hq, Tq, Tk)
        causal = torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]  # (Tq, Tk)
        for start, stop in [(0, q_len), (0, 1), (q_len // 2, q_len)]:
            k_end = k_len - q_len + stop
            block = bias.rows(start, stop, k_end)
            expected = full[..., start:stop, :k_end]
            attendable = causal[start:stop, :k_end]
            torch.testing.assert_close(block[..., attendable], expected[..., attendable], atol=1e-6, rtol=0)
        elementwise = bias.elementwise()
        assert (
            elementwise is not None
        )  # every encoding's bias can be said per score (FlexAttention serves it)
        b, h, i, j = torch.meshgrid(
            torch.arange(full.shape[0]),
            torch.arange(full.shape[1]),
            torch.arange(q_len),
            torch.arange(k_len),
            indexing="ij",
        )
        with torch.no_grad():
            scores = elementwise(b, h, i, j)
        torch.testing.assert_close(scores[..., causal], full[..., causal], atol=1e-6, rtol=0)


def test_the_structured_forms_are_the_biases_they_name():
    """A LinearDistanceBias is -slope_h * (i - j); a CumulativeBias is sum_{l=j+1}^{i} g_l (fp64 loop)."""
    slopes = torch.tensor([0.5, 0.125])
    linear = LinearDistanceBias(3, 7, slopes).full()[0]  # (H, 3, 7)
    for i in range(3):
        for j in range(4 + i + 1):
            torch.testing.assert_close(linear[:, i, j], -slopes * (4 + i - j), atol=0, rtol=0)
    g = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    cumulative = CumulativeBias(g, g.double().cumsum(-1).float()).full()  # (B, H, T, T)
    for i in range(8):
        for j in range(i + 1):
            expected = g[..., j + 1 : i + 1].double().sum(-1)
            torch.testing.assert_close(cumulative[..., i, j].double(), expected, atol=1e-5, rtol=0)


def _reference(q, k, v, bias, allowed, softmax_scale):
    """fp64 softmax(q k^T * softmax_scale + bias, masked) v with explicit scores: (B, Tq, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * softmax_scale + bias.double()
    scores = scores.masked_fill(~allowed, -math.inf)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 23),
    extra_keys=st.integers(0, 9),
    block=st.integers(1, 8),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    form=st.sampled_from(["by_distance", "separable", "rows"]),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_attend_chunked_equals_an_fp64_softmax(q_len, extra_keys, block, heads, form, padding, seed):
    """For any shape, block size, GQA ratio, bias form and left padding of row 1."""
    generator = torch.Generator().manual_seed(seed)
    k_len = q_len + extra_keys
    hq, hkv = heads
    q = torch.randn(2, hq, q_len, 8, generator=generator)
    k = torch.randn(2, hkv, k_len, 8, generator=generator)
    v = torch.randn(2, hkv, k_len, 8, generator=generator)
    table = torch.randn(hq, k_len, generator=generator)
    terms = torch.randn(2, hq, k_len, generator=generator).cumsum(-1)
    rows_i = torch.arange(k_len - q_len, k_len)[:, None]
    columns = torch.arange(k_len)[None, :]
    distance = (rows_i - columns).clamp(min=0)  # (Tq, Tk)
    dense = {
        "by_distance": table[:, distance][None],
        "separable": terms[..., -q_len:, None] - terms[..., None, :],
        "rows": table[:, distance][None] * 0.5 + 1.0,
    }[form]
    bias = {
        "by_distance": lambda: DistanceBias(q_len, k_len, table),
        "separable": lambda: SeparableBias(q_len, k_len, terms[..., -q_len:], terms),
        "rows": lambda: RowBias(q_len, k_len, lambda s, e, end: dense[..., s:e, :end]),
    }[form]()
    allowed = (columns <= rows_i)[None, None].expand(2, 1, q_len, k_len).clone()
    allowed[1, :, :, : min(padding, k_len - 1)] = False
    allowed[1, :, :, k_len - q_len :] |= torch.eye(q_len, dtype=torch.bool)  # padded queries see themselves
    mask = allowed if padding else None
    expected = _reference(q, k, v, dense, allowed, 0.3)
    out = attend_chunked(q, k, v, bias=bias, mask=mask, softmax_scale=0.3, block=block)
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


def test_chunked_bf16_stays_within_transformers_sdpa_vs_eager_tolerance():
    """bf16 on CPU: transformers accepts sdpa vs eager within atol = rtol = 1e-2."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, generator=generator) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    bias = DistanceBias(64, 64, -slopes[:, None] * torch.arange(64.0))
    causal = torch.ones(64, 64, dtype=torch.bool).tril()[None, None]
    expected = _reference(q, k, v, bias.full(), causal, 0.25).float()
    out = attend_chunked(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), bias=bias, mask=None, softmax_scale=0.25, block=16
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
def test_flex_serves_every_block_encoding_without_falling_back(case, monkeypatch):
    """Without gradients (FlexAttention has no CPU backward) flex itself serves each encoding."""

    def no_fallback(*args, **kwargs):
        raise AssertionError("fell back to the chunked backend")

    name, params = case
    models = _models("llama", name, params, ("eager", "flex"))
    monkeypatch.setattr(chunked, "attend_chunked", no_fallback)
    ids = token_ids(2, 17)
    with torch.no_grad():
        torch.testing.assert_close(models["flex"](ids).logits, models["eager"](ids).logits, atol=ATOL, rtol=0)


def test_flex_serves_by_distance_and_separable_but_not_rows():
    """attend_flex returns None (the caller falls back to chunked) for a row-function bias
    that cannot say its bias per score, and off CUDA whenever gradients are recorded."""
    q = k = v = torch.randn(1, 2, 6, 8)
    rows = RowBias(6, 6, lambda s, e, end: torch.zeros(1, 2, e - s, end))
    assert attend_flex(q, k, v, bias=rows, mask=None, softmax_scale=1.0) is None
    table = DistanceBias(6, 6, torch.randn(2, 6))
    with torch.no_grad():
        assert attend_flex(q, k, v, bias=table, mask=None, softmax_scale=1.0).shape == (1, 6, 2, 8)
    assert attend_flex(q, k, v, bias=table, mask=None, softmax_scale=1.0) is None  # no CPU backward: chunked


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


def test_auto_uses_the_chunked_core_on_cpu_and_sdpa_does_not(monkeypatch):
    calls = []
    original = chunked.attend_chunked
    monkeypatch.setattr(chunked, "attend_chunked", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = token_ids(1, 9)
    with torch.no_grad():
        patch(make_model("llama"), "alibi")(ids)
        assert len(calls) == 2  # one per layer
        patch(make_model("llama"), "alibi", backend="sdpa")(ids)
        patch(make_model("llama"), "rope")(ids)  # no score bias: the plain core
    assert len(calls) == 2


@CUDA
@pytest.mark.parametrize("case", BLOCK_CASES, ids=BLOCK_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_auto_backend_equals_eager(case, dtype):
    """On a GPU: flash-attn ALiBi / compiled FlexAttention / chunked equal eager. fp32: within 1e-4
    (GPU kernels accumulate in another order than the eager matmul + softmax; measured up to 3.7e-5
    on an H100). bf16: the fused path is no further from the fp32 eager reference than the eager
    path in bf16 is (twice its error plus bf16's resolution at these logits, 1/64)."""
    name, params = case
    models = _models("llama", name, params, ("eager", "auto"))
    ids = token_ids(2, 300).cuda()
    with torch.no_grad():
        reference = models["eager"].cuda()(ids).logits.float()
        logits = [models[b].cuda().to(dtype)(ids).logits.float() for b in ("eager", "auto")]
    if dtype == torch.float32:
        torch.testing.assert_close(logits[1], reference, atol=1e-4, rtol=0)
        return
    eager_error = (logits[0] - reference).abs().max().item()
    fused_error = (logits[1] - reference).abs().max().item()
    assert fused_error <= 2 * eager_error + 1 / 64, (fused_error, eager_error)


#: encodings with explicit scores (transform_scores / normalize), each row-local
ROW_CASES = [
    ("cope", {}),
    ("cape", {}),
    ("cape", {"base": "kerple"}),
    ("cape", {"base": "fire", "base_params": {"init_L": 6.0}}),
    ("sba", {}),
    ("sba", {"attend_current": True, "remainder": "drop"}),
]
ROW_IDS = [name + ("-" + "-".join(f"{k}={v}" for k, v in p.items()) if p else "") for name, p in ROW_CASES]


@pytest.mark.parametrize("case", ROW_CASES, ids=ROW_IDS)
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_explicit_score_encodings_in_query_blocks_equal_eager(family, case):
    """auto runs cope/cape/sba one block of queries at a time (each with its causal keys):
    logits with and without left padding, gradients, and cached decoding equal eager's."""
    from transformers import DynamicCache

    name, params = case
    models = _models(family, name, params, ("eager", "auto"))
    assert models["auto"].posenc.rows_independent()
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.clone()
    labels[1, :5] = -100  # positions predicted from padding
    outputs = {}
    for backend, model in models.items():
        model.zero_grad()
        plain = model(ids)
        padded = model(ids, attention_mask=mask, labels=labels)
        padded.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            steps = [model(ids[:1, :12], past_key_values=cache, use_cache=True).logits]
            steps.append(model(ids[:1, 12:], past_key_values=cache, use_cache=True).logits)
        outputs[backend] = (plain.logits.detach(), padded.logits.detach(), grads, torch.cat(steps, dim=1))
    (p_e, pad_e, g_e, _), (p_a, pad_a, g_a, steps_a) = outputs["eager"], outputs["auto"]
    torch.testing.assert_close(p_a, p_e, atol=ATOL, rtol=0)
    torch.testing.assert_close(pad_a[0], pad_e[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(pad_a[1, 4:], pad_e[1, 4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps_a, p_e[:1], atol=ATOL, rtol=0)
    assert g_a.keys() == g_e.keys()
    for n in g_e:
        torch.testing.assert_close(g_a[n], g_e[n], atol=ATOL, rtol=1e-4, msg=n)


def test_fire_linear_pieces_equal_the_mlp_and_follow_in_place_updates():
    """FIRE's piecewise-linear evaluation equals its MLP on every attendable (i, j), also after
    an in-place update of the MLP (an optimizer step) between two no-grad calls (cached pieces)."""
    from hf_posenc.encodings.fire import FIREFunction

    torch.manual_seed(0)
    function = FIREFunction(heads=4, width=8, init_c=0.1, init_L=6.0)
    distance = torch.arange(20)[:, None] - torch.arange(20)[None]  # (T, T) i - j
    positions = torch.arange(20)[None]
    attendable = distance >= 0
    with torch.no_grad():
        for _ in range(2):
            for p in function.parameters():
                p.add_(torch.randn(p.shape) * 0.5)
            pieces = function.evaluate_pieces(distance, positions)
            mlp = function(distance, positions)
            torch.testing.assert_close(pieces[..., attendable], mlp[..., attendable], atol=1e-6, rtol=1e-5)


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


#: registered backends that serve only on CUDA with an optional package, each covered here by a
#: test with a stand-in kernel written from the package's documented semantics
STAND_IN_TESTS = {
    "flash_alibi": "test_flash_alibi_path_passes_bthd_layout_causal_and_the_slopes",
    "fla_forgetting": "test_fla_forgetting_path_passes_bthd_layout_and_log_gates",
    "fla_stickbreaking": "test_fla_stickbreaking_path_equals_the_eager_sba",
}


def test_row_cases_cover_every_encoding_with_explicit_score_stages():
    explicit = {"transform_scores", "normalize"}
    with_rows = {info.name for info in hf_posenc.list_encodings() if explicit & set(info.stages)}
    assert with_rows == {name for name, _ in ROW_CASES}


def test_every_encoding_on_every_backend_choice_equals_eager_and_every_backend_is_covered(monkeypatch):
    """Every registered encoding, patched with every ``backend=`` choice, gives eager's logits (with
    and without left padding); the backends that served, plus the CUDA kernels' stand-in tests,
    are every registered backend (a new backend must join this matrix or name its own test)."""
    import hf_posenc.attention as attention

    served: set[str] = set()
    for backend in attention.registered_backends():
        original = backend.attend

        def spy(call, backend=backend, original=original):
            result = original(call)
            if result is not None:
                served.add(backend.name)
            return result

        monkeypatch.setattr(backend, "attend", spy)
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for info in hf_posenc.list_encodings():
        models = _models("llama", info.name, {}, attention.BACKENDS)
        with torch.no_grad():
            reference = models["eager"](ids).logits
            padded_reference = models["eager"](ids, attention_mask=mask).logits
            for choice, model in models.items():
                logits = model(ids).logits
                padded = model(ids, attention_mask=mask).logits
                msg = f"{info.name} backend={choice}"
                torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0, msg=msg)
                torch.testing.assert_close(padded[0], padded_reference[0], atol=ATOL, rtol=0, msg=msg)
                torch.testing.assert_close(padded[1, 4:], padded_reference[1, 4:], atol=ATOL, rtol=0, msg=msg)
    registered = {backend.name for backend in attention.registered_backends()}
    assert all(name in globals() for name in STAND_IN_TESTS.values())
    assert served | set(STAND_IN_TESTS) == registered, registered - served - set(STAND_IN_TESTS)


def test_a_backend_failure_is_remembered_per_model_not_per_process(monkeypatch):
    """A backend that fails (as FlexAttention does when a kernel cannot compile: it adds itself to
    the call's ``failures``) is not asked again by that model, and still is by another model."""
    from hf_posenc.attention import backend as registry
    from hf_posenc.core.patch import PATCH_ATTRIBUTE

    asked = []

    class Failing(registry.Backend):
        name = "failing_for_test"
        priority = 1000
        requests = frozenset({"auto"})

        def serves(self, call):
            return True

        def attend(self, call):
            asked.append(id(call.failures))
            call.failures.add(self.name)
            return None  # the dispatcher goes on to the next backend

    monkeypatch.setitem(registry._REGISTRY, Failing.name, Failing())
    first, second = patch(make_model("llama"), "alibi"), patch(make_model("llama"), "alibi")
    ids = token_ids(1, 9)
    with torch.no_grad():
        reference = first(ids).logits
        torch.testing.assert_close(first(ids).logits, reference)
        torch.testing.assert_close(second(ids).logits, second(ids).logits)
    runtimes = [getattr(model, PATCH_ATTRIBUTE).runtime.parts[0] for model in (first, second)]
    assert asked == [id(runtimes[0].failed_backends), id(runtimes[1].failed_backends)]
    assert all(runtime.failed_backends == {Failing.name} for runtime in runtimes)
