"""Peer equivalences: each encoding agrees with another library's own implementation of it
(transformers' Llama RoPE scalings, BLOOM's ALiBi, T5's relative buckets), or with an
equivalent parametrisation of itself that its paper states (ExPE/ExQPE linear scaling)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, make_model, token_ids
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

import hf_posenc
from hf_posenc.encodings.alibi import alibi_slopes
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.rope_scaling import inverse_frequencies, resolve_scaling
from hf_posenc.encodings.t5 import relative_position_bucket

LENGTH = 40  # long enough that positions x frequencies differ clearly between schedules


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# -- RoPE against transformers' native Llama rotary embedding ------------------------------


def test_rope_defaults_reproduce_native_llama_logits():
    """patch_model(llama, 'rope') with defaults gives the unpatched Llama's logits."""
    model = make_model("llama")
    ids = token_ids(2, LENGTH)
    native = logits(model, ids)
    hf_posenc.patch_model(model, "rope")
    torch.testing.assert_close(logits(model, ids), native, atol=1e-5, rtol=1e-5)


def test_rope_linear_scaling_equals_native_llama_linear_rope():
    """rope scaling={'type':'linear','factor':4} equals transformers' native linear rope_type."""
    plain = make_model("llama")
    config = copy.deepcopy(plain.config)
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    native_scaled = AutoModelForCausalLM.from_config(config).eval()
    native_scaled.load_state_dict(plain.state_dict())
    inv_freq = native_scaled.model.rotary_emb.inv_freq
    expected_inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16) / 4.0
    # guard: the peer really uses linear scaling (otherwise the comparison below is vacuous)
    torch.testing.assert_close(inv_freq.double(), expected_inv_freq, rtol=1e-6, atol=0)

    ids = token_ids(2, LENGTH)
    expected = logits(native_scaled, ids)
    unscaled = logits(plain, ids)
    assert not torch.allclose(expected, unscaled, atol=1e-3), "linear scaling should change the logits"
    hf_posenc.patch_model(plain, "rope", scaling={"type": "linear", "factor": 4.0})
    torch.testing.assert_close(logits(plain, ids), expected, atol=1e-5, rtol=1e-5)


ORIGINAL = 64
HEAD_DIM = 16
THETA = 10000.0


def hf_rope(rope_type: str, extra: dict, seq_len: int | None, max_positions: int = ORIGINAL):
    config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": rope_type, "rope_theta": THETA, **extra},
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len)
    return inv_freq, float(factor)


ROPE_PEER_CASES = [
    ("linear", {"factor": 4.0}),
    ("linear", {"factor": 0.5}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    ("yarn", {"factor": 16.0, "original_max_position_embeddings": 16}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 2048, "truncate": False}),
    ("yarn", {"factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.3}),
    (
        "llama3",
        {
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    (
        "llama3",
        {
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    (
        "llama3",
        {
            "factor": 4.0,
            "original_max_position_embeddings": 300,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
        },
    ),
]


@pytest.mark.parametrize(
    ("rope_type", "extra"), ROPE_PEER_CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(ROPE_PEER_CASES)]
)
def test_rope_scaling_frequencies_equal_transformers(rope_type, extra):
    """inverse_frequencies and the attention factor equal transformers' ROPE_INIT_FUNCTIONS."""
    expected, expected_factor = hf_rope(rope_type, extra, None)
    ours, factor = inverse_frequencies(
        HEAD_DIM, THETA, resolve_scaling({"type": rope_type, **extra}, ORIGINAL)
    )
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-12)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("factor", [2.0, 4.0, 1.0])
@pytest.mark.parametrize("seq_len", [1, 10, 32, 63, 64, 65, 100, 128, 1000])
def test_rope_dynamic_frequencies_equal_transformers(seq_len, factor):
    """Dynamic NTK: unchanged up to the original length, transformers' stretched base past it."""
    expected, expected_factor = hf_rope("dynamic", {"factor": factor}, seq_len, max_positions=ORIGINAL)
    scaling = resolve_scaling({"type": "dynamic", "factor": factor}, ORIGINAL)
    ours, attention_factor = inverse_frequencies(HEAD_DIM, THETA, scaling, seq_len)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-12)
    assert attention_factor == expected_factor == 1.0


# -- ALiBi against BLOOM ---------------------------------------------------------------------


@pytest.mark.parametrize("num_heads", [8, 12, 16])
def test_alibi_slopes_equal_bloom(num_heads):
    """alibi_slopes(H) equals the slopes in BLOOM's build_alibi_tensor."""
    mask = torch.ones(1, 2, dtype=torch.long)
    alibi = build_alibi_tensor(mask, num_heads, torch.float32)
    assert alibi.shape == (num_heads, 1, 2)  # (batch * heads, 1, key length)
    # BLOOM's bias is slope * (cumsum(mask) - 1): 0 at key 0, the slope itself at key 1
    assert torch.all(alibi[:, 0, 0] == 0)
    bloom_slopes = alibi[:, 0, 1]
    # BLOOM raises fp32 bases to integer powers in fp32; allow a few ulps
    torch.testing.assert_close(alibi_slopes(num_heads), bloom_slopes, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("family", "num_heads"), [("llama", 4), ("llama", 8), ("gpt2", 4), ("mistral", 4)])
def test_patched_alibi_bias_equals_bloom_slopes_times_distance(family, num_heads):
    """The patched model's score bias is -m_h (i - j) with BLOOM's slopes m_h, for j <= i."""
    overrides = (
        {"num_attention_heads": num_heads, "num_key_value_heads": num_heads} if family != "gpt2" else {}
    )
    if family == "llama" and num_heads == 8:
        overrides["head_dim"] = 8
    model = make_model(family, **overrides)
    hf_posenc.patch_model(model, "alibi")
    length = 9
    bias = model.posenc.score_bias(probe_call(model.posenc.geometry, length, length)).full()[0]
    assert bias.shape == (num_heads, length, length)
    slopes = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)[:, 0, 1]
    for i in range(length):
        for j in range(i + 1):
            torch.testing.assert_close(bias[:, i, j], -slopes * (i - j), rtol=1e-6, atol=1e-7)


# -- T5 buckets against transformers' T5Attention ----------------------------------------


T5_CASES = sorted({(b, d) for b in (2, 4, 8, 16, 32, 64) for d in (b // 2 + 1, b, 2 * b + 3, 128, 500)})


@pytest.mark.parametrize(("num_buckets", "max_distance"), T5_CASES)
def test_t5_buckets_equal_transformers_causal(num_buckets, max_distance):
    """relative_position_bucket(i - j) equals T5Attention._relative_position_bucket(j - i, causal)."""
    distance = torch.arange(0, 601)  # i - j
    expected = T5Attention._relative_position_bucket(
        -distance, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance
    )
    ours = relative_position_bucket(distance, num_buckets, max_distance)
    assert torch.equal(ours, expected), (ours != expected).nonzero()[:5].flatten().tolist()


SEED_001_TABLE = [
    [0],
    [1, 0],
    [2, 1, 0],
    [2, 2, 1, 0],
    [3, 2, 2, 1, 0],
    [3, 3, 2, 2, 1, 0],
    [4, 3, 3, 2, 2, 1, 0],
    [4, 4, 3, 3, 2, 2, 1, 0],
    [4, 4, 4, 3, 3, 2, 2, 1, 0],
    [4, 4, 4, 4, 3, 3, 2, 2, 1, 0],
]


def test_t5_buckets_reproduce_seed_001_table_for_b5_d6():
    """B=5, D=6: the 10x10 bucket table equals seed 001's worked table (upper triangle 0)."""
    expected = torch.zeros(10, 10, dtype=torch.long)
    for i, row in enumerate(SEED_001_TABLE):
        expected[i, : i + 1] = torch.tensor(row)
    i = torch.arange(10)[:, None]
    j = torch.arange(10)[None, :]
    assert torch.equal(relative_position_bucket(i - j, 5, 6), expected)


def test_t5_score_bias_uses_seed_001_buckets():
    """The patched t5 bias at (h, i, j) is table[bucket(i - j), h] with seed 001's buckets."""
    model = make_model("llama")
    hf_posenc.patch_model(model, "t5", num_buckets=5, max_distance=6)
    with torch.no_grad():
        model.posenc.tables[0].weight.copy_(torch.arange(5.0)[:, None] * 10 + torch.arange(4.0)[None, :])
    bias = model.posenc.score_bias(probe_call(model.posenc.geometry, 10, 10)).full()[0]
    for i, row in enumerate(SEED_001_TABLE):
        for j, bucket in enumerate(row):
            assert bias[:, i, j].tolist() == [bucket * 10.0 + h for h in range(4)]


# -- ExPE / ExQPE: linear scaling by f equals dividing the slopes by f -------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_expe_linear_factor_2_equals_half_theta(family):
    """ExPE with scaling linear f=2 gives the logits of ExPE with theta/2 (S=0)."""
    ids = token_ids(2, 16)
    theta = 0.05
    scaled = hf_posenc.patch_model(
        make_model(family), "expe", theta=theta, scaling={"type": "linear", "factor": 2.0}
    )
    halved = hf_posenc.patch_model(make_model(family), "expe", theta=theta / 2)
    unscaled = hf_posenc.patch_model(make_model(family), "expe", theta=theta)
    expected = logits(halved, ids)
    assert not torch.allclose(logits(unscaled, ids), expected, atol=1e-4)
    torch.testing.assert_close(logits(scaled, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_exqpe_linear_factor_2_equals_half_thetas(family):
    """ExQPE with scaling linear f=2 gives the logits of ExQPE with theta1/2 and theta2/2 (S=0)."""
    ids = token_ids(2, 16)
    theta1, theta2 = 0.05, 0.5
    scaled = hf_posenc.patch_model(
        make_model(family), "exqpe", theta1=theta1, theta2=theta2, scaling={"type": "linear", "factor": 2.0}
    )
    halved = hf_posenc.patch_model(make_model(family), "exqpe", theta1=theta1 / 2, theta2=theta2 / 2)
    unscaled = hf_posenc.patch_model(make_model(family), "exqpe", theta1=theta1, theta2=theta2)
    expected = logits(halved, ids)
    assert not torch.allclose(logits(unscaled, ids), expected, atol=1e-4)
    torch.testing.assert_close(logits(scaled, ids), expected, atol=1e-5, rtol=1e-5)
