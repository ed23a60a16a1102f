"""Property: every patched attention layer equals the independent reference computed from its
encoding's formula (tests/references/: loops and explicit matrices, fp64, reading only the
model's weights and the encoding's raw parameters), for every encoding x family; and
embedding-stage encodings add exactly the formula's vectors."""

from __future__ import annotations

import pytest
import references
import torch
from capture import LENGTH, run_and_capture
from conftest import CASES as CLASSICAL_CASES
from conftest import (
    DEFAULT_CASES,
    ENCODING_FILE_FAMILIES,
    ENCODINGS,
    FAMILIES,
    ROTARY_FAMILIES,
    make_model,
    patch,
    token_ids,
)
from encoding_cases import REFERENCE_CASES, ROPE_CHECKPOINT_ONLY, case_id
from references.sinusoidal import sinusoidal_vector

import hf_posenc.attention.chunked as chunked


def reference_pairs() -> list:
    """(family, case) pairs: the classical encodings (the yardstick the families are checked with)
    on every family, each encoding's defaults and, on ENCODING_FILE_FAMILIES, every variant; the
    extensions of a RoPE checkpoint on every rotary family (the others refuse them); the other
    encodings' REFERENCE_CASES on ENCODING_FILE_FAMILIES (one family per layout their stages see)."""
    classical = [
        (family, case)
        for family in FAMILIES
        for case in (CLASSICAL_CASES if family in ENCODING_FILE_FAMILIES else DEFAULT_CASES)
    ]
    others = [
        (family, case)
        for case in REFERENCE_CASES
        if case[0] not in ENCODINGS
        for family in (ROTARY_FAMILIES if case[0] in ROPE_CHECKPOINT_ONLY else ENCODING_FILE_FAMILIES)
    ]
    return [pytest.param(family, case, id=f"{family}-{case_id(case)}") for family, case in classical + others]


@pytest.mark.parametrize(("family", "case"), reference_pairs())
def test_patched_attention_equals_formula_reference(family, case, monkeypatch):
    """Every patched attention layer (random encoding parameters; Mistral's sliding window
    included) equals its encoding's fp64 formula reference."""
    name, params = case
    if name in ROPE_CHECKPOINT_ONLY:  # their neighbour backend in blocks of 5 queries: inputs span several
        monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)
    model = patch(make_model(family), name, params)
    records, attention = run_and_capture(model, token_ids(2, LENGTH))
    expected = references.attention_outputs(name, params, model, attention, records)
    for layer_idx, want in enumerate(expected):
        output = records[layer_idx][1]
        torch.testing.assert_close(output.double(), want, atol=1e-5, rtol=1e-5, msg=f"layer {layer_idx}")


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
        table = torch.tensor([sinusoidal_vector(t, d) for t in range(LENGTH)], dtype=torch.float64)
    elif name == "learned":
        table = model.posenc.table[:LENGTH].double()
    else:  # every other encoding removes the model's own absolute positions (GPT-2's wpe) and adds none
        table = torch.zeros(LENGTH, d, dtype=torch.float64)
    torch.testing.assert_close(records["layer0_input"].double(), tokens + table, atol=1e-6, rtol=1e-6)
