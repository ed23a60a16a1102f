"""Property: every patched attention layer equals an independent reference computed from
the encoding's formula (tests/reference.py: loops and explicit matrices, fp64), for every
encoding x family; and embedding-stage encodings add exactly the formula's vectors."""

from __future__ import annotations

import reference as ref
import torch
from capture import LENGTH, run_and_capture
from conftest import make_model, native_window, num_query_heads, patch, token_ids
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def reference_inv_freq(params: dict, head_dim: int, seq_len: int) -> tuple[list[float], float]:
    """RoPE frequencies: the formula for plain/linear/ntk, transformers' own functions for the rest."""
    theta = params.get("theta", 10000.0)
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    scaling = params.get("scaling")
    plain = [theta ** (-2 * i / rotary) for i in range(rotary // 2)]
    if scaling is None:
        return plain, 1.0
    if scaling["type"] == "linear":
        return [w / scaling["factor"] for w in plain], 1.0
    original = scaling["original_max_position_embeddings"]
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=original,
        rope_parameters={
            "rope_type": scaling["type"],
            "rope_theta": theta,
            "factor": scaling["factor"],
            "original_max_position_embeddings": original,
        },
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["type"]](config, None, seq_len)
    return inv_freq.double().tolist(), float(factor)


def native_rope(model, layer_idx: int) -> tuple[float, bool]:
    """(theta, rotates) of layer ``layer_idx`` as the config states them: Gemma 3 nests
    ``rope_parameters`` by layer type; SmolLM3's ``no_rope_layers`` is 0 on its NoPE layers."""
    config = model.config
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] in params:
        params = params[layer_types[layer_idx]]
    no_rope_layers = getattr(config, "no_rope_layers", None)
    rotates = no_rope_layers is None or bool(no_rope_layers[layer_idx])
    return float(params.get("rope_theta", 10000.0)), rotates


def layer_reference(name, params, module, hidden, model, layer_idx):
    geometry_d = hidden.shape[-1]
    heads = num_query_heads(model)
    kwargs = dict(softmax_scale=module.scaling, window=native_window(model, layer_idx))
    theta, rotates = native_rope(model, layer_idx)
    if name == "rope" and "theta" not in params:
        params = {**params, "theta": theta}
    if name == "rope" and not rotates:
        pass  # rope leaves the model's natively position-free layers alone
    elif name == "rope":
        # causal dynamic NTK: query i uses the frequencies for length i + 1; others: one schedule
        dynamic = params.get("scaling", {}).get("type") == "dynamic"
        matrices = {}
        for i in range(LENGTH):
            inv_freq, factor = reference_inv_freq(
                params, module.head_dim, seq_len=i + 1 if dynamic else LENGTH
            )
            for t in range(i + 1):
                matrices[t, i] = ref.rotation_matrix(t, inv_freq, module.head_dim, factor)
        kwargs["rotation"] = lambda t, i: matrices[t, i]
    elif name == "xpos":
        cfg = model.posenc.config  # the resolved defaults (theta: the model's) as parameters
        full = {**params, "theta": cfg.theta}
        inv_freq, factor = reference_inv_freq(full, module.head_dim, seq_len=LENGTH)
        scaling = params.get("scaling") or {}
        divisor = scaling["factor"] if scaling.get("type") == "linear" else 1.0
        maps = {
            t: ref.xpos_matrices(
                t,
                inv_freq,
                module.head_dim,
                scale_base=params.get("scale_base", 512.0),
                gamma=params.get("gamma", 0.4),
                decay_position=t / divisor,
                attention_factor=factor,
            )
            for t in range(LENGTH)
        }
        kwargs["rotation"] = lambda t, i: maps[t][0]
        kwargs["key_rotation"] = lambda t, i: maps[t][1]
    elif name == "alibi":
        slopes = ref.alibi_slopes(heads)
        kwargs["bias"] = lambda h, i, j: -slopes[h] * (i - j)
    elif name == "t5":
        shared = params.get("shared_across_layers", True)
        table = model.posenc.tables[0 if shared else layer_idx].weight.double()  # (buckets, heads)
        buckets, distance = params.get("num_buckets", 32), params.get("max_distance", 128)
        kwargs["bias"] = lambda h, i, j: float(table[ref.t5_bucket(i - j, buckets, distance), h])
    elif name in ("expe", "exqpe"):
        l = params.get("l", geometry_d // 8)  # noqa: E741
        factor = params.get("scaling", {}).get("factor", 1.0)
        S = params.get("S", 0.0)  # noqa: N806
        if name == "expe":
            kwargs["x_override"] = lambda t: ref.expe_values(t, l, S, params.get("theta", 1 / 2048), factor)
        else:
            kwargs["x_override"] = lambda t: ref.exqpe_values(
                t, l, S, params.get("theta1", 1 / 2048), params.get("theta2", 1 / 16), factor
            )
        kwargs["override_value"] = params.get("override_value", False)
    return ref.attention_layer(module, hidden, **kwargs)


def test_patched_attention_equals_formula_reference(family, case):
    name, params = case
    model = patch(make_model(family), name, params)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    for layer_idx, module in enumerate(attention):
        hidden, output = records[layer_idx]
        expected = layer_reference(name, params, module, hidden, model, layer_idx)
        torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


def test_embedding_stage_adds_formula_vectors(family, case):
    name, params = case
    model = patch(make_model(family), name, params)
    ids = token_ids(2, LENGTH)
    records, _ = run_and_capture(model, ids)
    embedding = model.get_input_embeddings()
    # Gemma's embedding module multiplies by its embed_scale (sqrt(hidden)); the encoding adds after it
    tokens = embedding.weight[ids].double() * float(getattr(embedding, "embed_scale", 1.0))  # (B, T, d)
    d = tokens.shape[-1]
    if name == "sinusoidal":
        table = torch.tensor([ref.sinusoidal_vector(t, d) for t in range(LENGTH)], dtype=torch.float64)
    elif name == "learned":
        table = model.posenc.table[:LENGTH].double()
    else:  # every other encoding removes the model's own absolute positions (GPT-2's wpe) and adds none
        table = torch.zeros(LENGTH, d, dtype=torch.float64)
    torch.testing.assert_close(records["layer0_input"].double(), tokens + table, atol=1e-6, rtol=1e-6)
