"""SelfExtend, ReRoPE and Leaky ReRoPE (training-free extension of a RoPE checkpoint): the eager
core against the fp64 explicit-score reference written from the papers' position maps
(tests/references/selfextend.py, rerope.py; the default neighbour block backend is checked
against it on every rotary family by tests/encodings/test_formula_references.py); decoding with a
KV cache over many steps with left padding; the degenerate settings that are plain RoPE; bad
input; reconfigure.
"""

from __future__ import annotations

import pytest
import torch
from capture import LENGTH, run_and_capture
from conftest import make_model, patch, token_ids
from encoding_cases import case_id, cases_of
from references import layer_reference
from transformers import DynamicCache

import hf_posenc
import hf_posenc.attention.chunked as chunked

CASES = cases_of("selfextend", "rerope", "leaky_rerope")


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    """Blocks of 5 queries, so every input spans several (the default is 256)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)


@pytest.mark.parametrize("case_", CASES, ids=[case_id(c) for c in CASES])
def test_eager_core_equals_the_papers_position_maps(case_):
    """backend="eager": the explicit (Tq, Tk) logits merged with ``where``."""
    name, params = case_
    model = patch(make_model("llama"), name, params, backend="eager")
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        expected = layer_reference(name, params, module, hidden, model, layer_idx)
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("case_", [c for c in CASES if c[1]], ids=[case_id(c) for c in CASES if c[1]])
def test_many_decoding_steps_with_left_padding_equal_the_full_forward(family, case_):
    """A left-padded batch decoded 30 steps with a KV cache: every step's logits equal a full
    forward over the sequence so far (the cached keys' near and far positions stay right)."""
    name, params = case_
    model = patch(make_model(family), name, params)
    ids = token_ids(2, 36)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        for t in range(6, 36):
            out = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            full = model(ids[:, : t + 1], attention_mask=mask[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(out.logits[:, -1], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize(
    "params",
    [{"window": 3, "logn": True}, {"window": 2, "leak": 4.0, "logn": True}],
    ids=["rerope", "leaky_rerope"],
)
def test_logn_scales_queries_past_the_trained_length_as_the_reference_code(params, backend):
    """logn=True (bojone/rerope's ``query_states *= (log(n + 1) / log(training_length)).clip(1)``) on a
    model trained on 8 positions, run on 12: queries 8.. are scaled (fp64 reference), earlier ones not;
    KV-cache decoding over those positions equals the full forward."""
    name = "leaky_rerope" if "leak" in params else "rerope"
    model = patch(make_model("llama", max_position_embeddings=8), name, params, backend=backend)
    plain = patch(
        make_model("llama", max_position_embeddings=8), name, {**params, "logn": False}, backend=backend
    )
    ids = token_ids(2, LENGTH)
    records, attention = run_and_capture(model, ids)
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        expected = layer_reference(name, params, module, hidden, model, layer_idx)
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        scaled, unscaled = model(ids).logits, plain(ids).logits
        torch.testing.assert_close(scaled[:, :7], unscaled[:, :7], atol=1e-6, rtol=0)  # log(n+1) <= log 8
        assert (scaled[:, 8:] - unscaled[:, 8:]).abs().max() > 1e-4
        cache = DynamicCache(config=model.config)
        out = model(ids[:, :4], past_key_values=cache, use_cache=True)
        for t in range(4, LENGTH):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            torch.testing.assert_close(out.logits[:, -1], scaled[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("selfextend", {"group_size": 1, "window": 3}),  # groups of one: every position its own
        ("leaky_rerope", {"leak": 1.0, "window": 3}),  # slope 1 past the window: RoPE
        ("rerope", {"window": 64}),  # every test distance inside the window
    ],
)
def test_degenerate_settings_are_the_native_rope_model(name, params):
    """Reference: the unpatched checkpoint (its own RoPE)."""
    native = make_model("llama")
    ids = token_ids(2, 20)
    with torch.no_grad():
        expected = native(ids).logits
        patched = hf_posenc.patch_model(native, name, **params)
        torch.testing.assert_close(patched(ids).logits, expected, atol=1e-5, rtol=0)


def test_reconfigure_changes_the_window_and_group_in_place():
    model = patch(make_model("llama"), "selfextend", {"group_size": 2, "window": 4})
    fresh = patch(make_model("llama"), "selfextend", {"group_size": 3, "window": 6})
    ids = token_ids(2, 20)
    hf_posenc.reconfigure(model, group_size=3, window=6)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, atol=0, rtol=0)
    assert hf_posenc.patch_info(model)["params"]["window"] == 6


@pytest.mark.parametrize(
    ("family", "name", "params", "match"),
    [
        ("gpt2", "selfextend", {}, "native positions are not RoPE"),
        ("gpt2", "rerope", {}, "native positions are not RoPE"),
        ("llama", "selfextend", {"group_size": 0}, "group_size=0"),
        ("llama", "selfextend", {"window": 0}, "window=0"),
        ("llama", "rerope", {"window": 65}, r"window=65 is not allowed; allowed: an integer in \[1, 64\]"),
        ("llama", "leaky_rerope", {"leak": 0.5}, "leak=0.5"),
        (
            "llama",
            "selfextend",
            {"scaling": {"type": "dynamic", "factor": 2.0}},
            "scaling='dynamic' is not allowed",
        ),
    ],
)
def test_bad_input_is_refused_in_one_line_and_the_model_is_untouched(family, name, params, match):
    model = make_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hf_posenc.InvalidParameterError, match=match) as error:
        hf_posenc.patch_model(model, name, **params)
    assert "\n" not in str(error.value)
    assert hf_posenc.patch_info(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_no_tensor_spans_every_query_and_key(monkeypatch):
    """The default path never attends all queries at once: with blocks of 5 queries over 40
    tokens, every part the block backend computes has at most 5 queries per head (2 query heads
    share a key head here and are stacked along the rows: 10)."""
    import hf_posenc.attention.softmax_parts as softmax_parts

    rows = []
    original = softmax_parts.kernels

    def spy(q, v, fused=True):
        forward, backward = original(q, v, fused)

        def spied(q, k, v, bias, scale):
            rows.append(q.shape[-2])
            return forward(q, k, v, bias, scale)

        return spied, backward

    monkeypatch.setattr(softmax_parts, "kernels", spy)
    model = patch(make_model("llama"), "selfextend", {"group_size": 2, "window": 4})
    with torch.no_grad():
        model(token_ids(1, 40))
    assert rows and max(rows) <= 10


RANGED = [
    ("selfextend", {"window": 4, "group_size": 2}),
    ("rerope", {"window": 3}),
    ("leaky_rerope", {"window": 3, "leak": 2.0}),
]


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("case_", RANGED, ids=[name for name, _ in RANGED])
def test_decoding_rotates_only_the_keys_each_map_reads(monkeypatch, case_, backend):
    """Decoding steps over a cache (key ranges from 4 keys more than queries on, instead of 256): a
    step rotates under the near map only the keys some query sees as neighbours (the last
    ``window``) and under the far map only its own new key, the cached keys' far rotations being
    kept in the layer's decoding state (their far positions are their own); ReRoPE's far map
    leaves keys unrotated (b(j) = 0), so none. Every step's logits still equal a full forward over
    the sequence so far (a left-padded batch: the padded row's positions lag by 3), on the
    neighbour and eager paths."""
    import hf_posenc.encodings.window_split as window_split
    from hf_posenc.compat import cache_keyword, output_cache

    monkeypatch.setattr(window_split, "RANGE_MIN_SKIPPED", 4)
    rotated: list[tuple[int, int]] = []  # (rows of the rotated tensor, its keys) per rotation
    original = window_split.apply_rotary

    def counting(x, cos, sin):
        rotated.append((x.shape[1], x.shape[-2]))
        return original(x, cos, sin)

    monkeypatch.setattr(window_split, "apply_rotary", counting)
    name, params = case_
    model = patch(make_model("llama"), name, params, backend=backend)
    heads, heads_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    window = params["window"]
    # per layer and step, rows of the KV heads rotated: the near map's window, the far map's new
    # key (none for ReRoPE), and the queries under both maps where they have the KV heads' count
    per_layer = window + (0 if name == "rerope" else 1) + (2 if heads == heads_kv else 0)
    ids = token_ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model(ids[:, :12], attention_mask=mask[:, :12], use_cache=True)
        for t in range(12, 30):
            rotated.clear()
            cache = {cache_keyword(model): output_cache(out)}
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], use_cache=True, **cache)
            key_rows = sum(keys for rows, keys in rotated if rows == heads_kv)
            assert key_rows == model.config.num_hidden_layers * per_layer, rotated
            full = model(ids[:, : t + 1], attention_mask=mask[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(out.logits[:, -1], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["selfextend", "leaky_rerope"])
def test_kept_far_keys_are_the_cached_keys_rotated_by_their_far_positions(name):
    """After a prompt and decoding steps, each layer's decoding state holds the cache's raw keys
    rotated by RoPE at the far map's key positions (SelfExtend: floor(j / G); Leaky ReRoPE: j /
    leak), computed here from the cache's keys with the checkpoint's RoPE."""
    from hf_posenc.core.decoding_state import STATES_ATTRIBUTE
    from hf_posenc.encodings.window_split import FAR_KEYS

    params = {"selfextend": {"window": 4, "group_size": 3}, "leaky_rerope": {"window": 3, "leak": 2.0}}[name]
    model = patch(make_model("llama"), name, params)
    ids = token_ids(1, 16)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :10], past_key_values=cache, use_cache=True)
        for t in range(10, 16):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
    states = next(iter(cache.__dict__[STATES_ATTRIBUTE].layers.values()))
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).double() / dim))
    positions = torch.arange(16).double()
    far = (
        torch.div(positions, params["group_size"], rounding_mode="floor")
        if name == "selfextend"
        else positions / 2.0
    )
    angles = far[:, None] * inv_freq[None]  # (T, D/2)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    for layer in range(config.num_hidden_layers):
        raw = cache.layers[layer].keys.double()  # (1, Hkv, 16, D), cached un-rotated
        half = dim // 2
        rotated = raw * cos + torch.cat((-raw[..., half:], raw[..., :half]), -1) * sin
        torch.testing.assert_close(states[layer][FAR_KEYS].double(), rotated, atol=1e-6, rtol=0)


def test_a_reconfigured_map_rebuilds_the_kept_far_keys(monkeypatch):
    """Decoding continued over the same cache after ``reconfigure`` changed the far map (group
    size and window) gives what it gives with no far keys kept (every step rotating every cached
    key under the map of the moment): the kept far keys of the old map are found stale (their far
    positions differ) and rotated again. (Not the reconfigured model's full forward: the cache's
    later layers hold keys and values computed under the old map.)"""
    import hf_posenc.encodings.window_split as window_split

    ids = token_ids(2, 20)

    def decode() -> list[torch.Tensor]:
        model = patch(make_model("llama"), "selfextend", {"window": 4, "group_size": 2})
        steps = []
        with torch.no_grad():
            out = model(ids[:, :10], past_key_values=DynamicCache(config=model.config), use_cache=True)
            for t in range(10, 20):
                if t == 14:
                    hf_posenc.reconfigure(model, window=3, group_size=4)
                out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits[:, -1])
        return steps

    kept = decode()
    monkeypatch.setattr(window_split.WindowSplitRoPE, "_far_keys", lambda *args: None)
    fresh = decode()
    for got, want in zip(kept, fresh, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["selfextend", "leaky_rerope"])
def test_beam_search_and_a_cropped_cache_keep_the_far_keys_aligned(monkeypatch, name):
    """The kept far keys follow the cache: beam search (its rows reordered every step) gives the
    sequences and scores it gives with the state off (every step rotating every key), and a
    cache cropped by two tokens (as assisted decoding rolls back) decodes on as a full forward."""
    import hf_posenc.encodings.window_split as window_split

    params = dict(RANGED)[name]
    model = patch(make_model("llama"), name, params)
    prompt = token_ids(2, 9)
    settings = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False, "output_scores": True}
    settings |= {"return_dict_in_generate": True, "pad_token_id": 0}
    with torch.no_grad():
        kept = model.generate(prompt, **settings)
        monkeypatch.setattr(window_split.WindowSplitRoPE, "_far_keys", lambda *args: None)
        fresh = model.generate(prompt, **settings)
    monkeypatch.undo()
    torch.testing.assert_close(kept.sequences, fresh.sequences)
    torch.testing.assert_close(kept.sequences_scores, fresh.sequences_scores, atol=1e-5, rtol=0)
    ids = token_ids(2, 16)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :12], past_key_values=cache, use_cache=True)
        cache.crop(-2)  # 10 tokens left
        for t in range(10, 16):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            full = model(ids[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(out.logits[:, -1], full, atol=1e-5, rtol=0)


def test_without_gradients_the_layers_share_one_forwards_rotation_tables(monkeypatch):
    """A forward without gradients builds each map's cos/sin tables once (near and far, queries
    and keys: 4), not once per layer; with gradients each layer's call builds its own (a
    backward may follow a second forward, whose tables have the same keys and other positions)."""
    import hf_posenc.encodings.window_split as window_split

    built = []
    original = window_split.cos_sin

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(window_split, "cos_sin", counting)
    model = patch(make_model("llama"), "selfextend", {"group_size": 2, "window": 4})
    layers = model.config.num_hidden_layers
    assert layers > 1
    with torch.no_grad():
        model(token_ids(1, 20))
    assert len(built) == 4
    built.clear()
    model(token_ids(1, 20)).logits.sum().backward()
    assert len(built) >= 4 * layers


def test_a_rope_checkpoint_loads_as_selfextend_with_its_rope_settings(tmp_path):
    """load_model(rope run, "selfextend"): the run's RoPE settings (here a linear scaling) carried
    over; reference: the same weights patched with selfextend and that scaling from the start.
    A checkpoint saved with another encoding is refused in one line."""
    scaling = {"type": "linear", "factor": 2.0}
    model = patch(make_model("llama"), "rope", {"scaling": scaling}, randomize=False)
    model.save_pretrained(tmp_path / "rope")
    loaded = hf_posenc.load_model(str(tmp_path / "rope"), "selfextend", {"group_size": 2, "window": 4})
    assert hf_posenc.patch_info(loaded)["params"]["scaling"] == scaling
    expected = patch(make_model("llama"), "selfextend", {"group_size": 2, "window": 4, "scaling": scaling})
    ids = token_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, atol=1e-6, rtol=0)
    patch(make_model("llama"), "alibi").save_pretrained(tmp_path / "alibi")
    with pytest.raises(
        ValueError, match="saved with encoding 'alibi'; cannot load it as 'selfextend'"
    ) as error:
        hf_posenc.load_model(str(tmp_path / "alibi"), "selfextend")
    assert "\n" not in str(error.value)


def test_keep_far_keys_off_keeps_no_state_and_decodes_the_same():
    """``keep_far_keys=False`` (the memory of one more copy of the keys saved): decoding keeps no
    far keys on the cache, every step rotates them again, and the logits are the kept path's."""
    from hf_posenc.core.decoding_state import STATES_ATTRIBUTE

    ids = token_ids(2, 14)
    logits = {}
    for keep in (True, False):
        model = patch(
            make_model("llama"), "selfextend", {"window": 4, "group_size": 2, "keep_far_keys": keep}
        )
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(ids[:, :8], past_key_values=cache, use_cache=True)
            steps = []
            for t in range(8, 14):
                out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1])
        states = cache.__dict__.get(STATES_ATTRIBUTE)
        kept = [] if states is None else [key for _, _, key in states.entries()]
        assert bool(kept) == keep
        logits[keep] = torch.stack(steps)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)


def test_repeated_rows_and_assisted_decoding_keep_the_far_keys_aligned():
    """Sampling several sequences per prompt (the cache's rows repeated) and assisted decoding
    (a draft model's rejected tokens cropped from the cache) give the tokens they give with no
    far keys kept (``keep_far_keys=False``), and the sampled steps' finite scores agree."""
    draft = make_model("llama", seed=3)
    results = {}
    for keep in (True, False):
        model = patch(
            make_model("llama"), "selfextend", {"window": 4, "group_size": 2, "keep_far_keys": keep}
        )
        torch.manual_seed(0)
        with torch.no_grad():
            sampled = model.generate(
                token_ids(2, 9),
                max_new_tokens=8,
                do_sample=True,
                num_return_sequences=3,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            assisted = model.generate(
                token_ids(1, 9), max_new_tokens=10, do_sample=False, assistant_model=draft, pad_token_id=0
            )
        results[keep] = (sampled.sequences, torch.stack(sampled.scores), assisted)
    (seq, scores, assisted), (seq0, scores0, assisted0) = results[True], results[False]
    torch.testing.assert_close(seq, seq0)
    torch.testing.assert_close(assisted, assisted0)
    finite = torch.isfinite(scores0)
    assert torch.equal(finite, torch.isfinite(scores))
    torch.testing.assert_close(scores[finite], scores0[finite], atol=1e-5, rtol=0)
