"""Every mask, cache, decoding mode and compiled forward of a patched model.

Part of the drop-in checks (issue 10): each test states what a user does with an ordinary
transformers model and checks that the patched model behaves like an independent, correctly
patched model — against references that do not go through the code path under test (a model
patched from scratch, each packed sequence run alone, the default cache, the eager forward).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DROPIN_ENCODINGS as ENCODINGS
from conftest import FAMILIES, make_model, patch, token_ids
from conftest import no_grad_logits as logits

import hf_posenc
from hf_posenc.errors import InvalidParameterError, UnsupportedModelError


# -- masks ------------------------------------------------------------------------------------------
def _block_causal_float_mask(lengths: list[int], dtype=torch.float32) -> torch.Tensor:
    """(1, 1, T, T) additive mask: each packed sequence attends causally to itself only."""
    total = sum(lengths)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    mask = torch.zeros(total, total, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ENCODINGS)
def test_packed_sequences_with_a_4d_float_mask_equal_each_sequence_alone(family, name):
    """Packed-sequence training: a 4D float block-causal mask with restarting ``position_ids``
    gives each sequence the logits it has alone."""
    model = patch(make_model(family), name)
    lengths = [5, 7, 4]
    sequences = [token_ids(1, n, seed=i) for i, n in enumerate(lengths)]
    packed = torch.cat(sequences, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out = logits(model, packed, attention_mask=_block_causal_float_mask(lengths), position_ids=position_ids)
    start = 0
    for seq, n in zip(sequences, lengths, strict=True):
        alone = logits(model, seq)
        assert torch.allclose(out[:, start : start + n], alone, atol=1e-5), (name, start)
        start += n


def _left_padded(batch: int, length: int, padding: int, device: str = "cpu") -> torch.Tensor:
    """(batch, length) 0/1 mask whose first row starts with ``padding`` pad tokens."""
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[0, :padding] = 0
    return mask


@pytest.mark.parametrize("name", ["rope", "alibi", "fox"])
def test_switching_to_eager_after_patching_keeps_the_patch(name):
    """``set_attn_implementation("eager")`` after patching: float masks arrive, the patch still applies."""
    model = patch(make_model("llama"), name)
    ids = token_ids(2, 10)
    mask = _left_padded(2, 10, 3)
    expected = logits(model, ids, attention_mask=mask)
    model.set_attn_implementation("eager")
    eager = logits(model, ids, attention_mask=mask)
    assert torch.allclose(eager[1], expected[1], atol=1e-5)
    assert torch.allclose(eager[0, 3:], expected[0, 3:], atol=1e-5)


def test_switching_to_an_unreadable_implementation_is_refused_clearly():
    model = patch(make_model("llama"), "alibi")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="flash_attention_2"):
        model(token_ids(1, 6))


def test_additive_mask_with_bias_values_is_refused():
    model = patch(make_model("llama"), "alibi")
    mask = _block_causal_float_mask([6])
    mask[..., 2, 0] = 0.5
    with pytest.raises(InvalidParameterError, match="additive float attention mask"):
        model(token_ids(1, 6), attention_mask=mask)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "chunked", "eager"])
@pytest.mark.parametrize("name", ["alibi", "fire", "expe"])
def test_output_attentions_returns_weights_on_every_backend(name, backend):
    """``output_attentions=True`` gives one (B, H, T, T) weight tensor per layer, rows summing to 1,
    causal, whatever the backend; the logits are unchanged."""
    model = patch(make_model("llama"), name, backend=backend)
    ids = token_ids(2, 9)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    assert len(out.attentions) == model.config.num_hidden_layers
    for weights in out.attentions:
        assert weights.shape == (2, model.config.num_attention_heads, 9, 9)
        assert torch.allclose(weights.sum(-1), torch.ones(2, model.config.num_attention_heads, 9), atol=1e-5)
        assert torch.all(weights.triu(1) == 0)
    assert torch.allclose(out.logits, logits(model, ids), atol=1e-5)


# -- generation modes ----------------------------------------------------------------------------
def _generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("name", ENCODINGS)
def test_static_cache_greedy_equals_default_cache(family, name):
    model = patch(make_model(family), name)
    ids = token_ids(2, 6)
    expected = _generate(model, ids)
    assert torch.equal(_generate(model, ids, cache_implementation="static"), expected)


@pytest.mark.parametrize("name", ENCODINGS)
def test_assisted_and_prompt_lookup_decoding_equal_greedy(name):
    """Speculative decoding crops the cache after rejected tokens: output equals plain greedy
    (or, for an encoding whose state cannot be rolled back, a clear error)."""
    model = patch(make_model("llama"), name)
    assistant = patch(make_model("llama", seed=3), name)
    ids = token_ids(1, 6)
    expected = _generate(model, ids)
    assert torch.equal(_generate(model, ids, assistant_model=assistant), expected)
    assert torch.equal(_generate(model, ids, prompt_lookup_num_tokens=2), expected)


@pytest.mark.parametrize("name", ["fox", "fox_pro", "alibi"])
def test_beam_search_equals_beam_search_without_cache(name):
    """Beam search reorders the cache: stateful encodings follow it."""
    model = patch(make_model("llama"), name)
    ids = token_ids(2, 5)
    kwargs = dict(num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_fox_cropped_cache_continues_like_the_shorter_prefix():
    """After ``cache.crop`` (what speculative decoding does), decoding continues exactly as if the
    removed tokens had never been fed."""
    model = patch(make_model("llama"), "fox")
    ids = token_ids(1, 10)
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).past_key_values
        cache.crop(-3)
        step = model(ids[:, 5:6], past_key_values=cache).logits[:, -1]
        full = model(ids[:, :6]).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-5)


def test_fox_pro_cropped_cache_is_refused_clearly():
    """FoX Pro's token shift keeps only the last raw key: a crop cannot be followed, so it is refused."""
    model = patch(make_model("llama"), "fox_pro")
    with torch.no_grad():
        cache = model(token_ids(1, 8), use_cache=True).past_key_values
        with pytest.raises(UnsupportedModelError, match="cropped"):
            cache.crop(-2)


# -- compile ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "alibi", "expe"])
def test_compiled_fullgraph_forward_with_mask_equals_eager(name):
    model = patch(make_model("llama"), name)
    ids = token_ids(2, 8)
    mask = _left_padded(2, 8, 2)
    expected = logits(model, ids, attention_mask=mask)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(out, expected, atol=1e-5)


# -- CUDA: offloaded caches, compiled static-cache generation -------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@CUDA
@pytest.mark.parametrize("name", ENCODINGS)
def test_cuda_offloaded_and_compiled_static_cache_generation_equal_default(name):
    """The fast serving path: an offloaded cache, and a static cache with transformers' compiled
    decoding step, give the default cache's greedy output."""
    from transformers import CompileConfig

    model = patch(make_model("llama"), name).cuda()
    ids = token_ids(2, 6).cuda()
    expected = _generate(model, ids)
    assert torch.equal(_generate(model, ids, cache_implementation="offloaded"), expected)
    torch._dynamo.reset()
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    if type(model.posenc).compiled_decoding_refusal() is not None:  # stateful: refused, in one line
        with pytest.raises(UnsupportedModelError, match=f"^{name}: a compiled decoding step"):
            _generate(model, ids, cache_implementation="static", compile_config=compile_config)
        assert torch.equal(_generate(model, ids, cache_implementation="static"), expected)  # eager
        return
    compiled = _generate(model, ids, cache_implementation="static", compile_config=compile_config)
    assert torch.equal(compiled, expected)


#: seen on an H100 (torch 2.11): a fullgraph compile around the block-bias backends fails inside
#: the nested FlexAttention call ("Attempted to call function marked as skipped"); strict, so a
#: fix is noticed
_NESTED_FLEX = pytest.mark.xfail(
    strict=True,
    reason=(
        "known: torch.compile(fullgraph=True) around the nested FlexAttention call fails on CUDA "
        "('Attempted to call function marked as skipped', H100, torch 2.11)"
    ),
)


@CUDA
@pytest.mark.parametrize(
    "name",
    ["rope", "expe", pytest.param("alibi", marks=_NESTED_FLEX), pytest.param("t5", marks=_NESTED_FLEX)],
)
def test_cuda_compiled_fullgraph_forward_with_mask_equals_eager(name):
    model = patch(make_model("llama"), name).cuda()
    ids = token_ids(2, 40).cuda()
    mask = _left_padded(2, 40, 5, device="cuda")
    expected = logits(model, ids, attention_mask=mask)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(out, expected, atol=1e-4)


def test_patching_keeps_the_users_attention_implementation():
    """``config._attn_implementation`` stays what the user chose (sdpa or eager): transformers'
    own rules for it (``output_attentions`` on an eager config) keep applying."""
    model = make_model("llama")
    model.set_attn_implementation("eager")
    hf_posenc.patch_model(model, "alibi")
    assert model.config._attn_implementation == "eager"
    model.config.output_attentions = True  # allowed on an eager config, as natively
    with torch.no_grad():
        out = model(token_ids(1, 7))
    assert len(out.attentions) == model.config.num_hidden_layers


def test_output_attentions_over_a_static_cache_span_the_whole_cache():
    """As natively, attention maps over a pre-allocated cache have its full length (unused slots 0)."""
    from transformers import StaticCache

    model = patch(make_model("llama"), "alibi")
    cache = StaticCache(config=model.config, max_cache_len=12)
    with torch.no_grad():
        out = model(token_ids(1, 7), past_key_values=cache, output_attentions=True, use_cache=True)
    weights = out.attentions[0]
    assert weights.shape[-1] == 12
    assert torch.all(weights[..., 7:] == 0)
    assert torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-5)
