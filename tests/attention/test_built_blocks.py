"""Blocks whose bias is written out (FIRE past its threshold L) without gradients: each block takes
as many queries as keep the one buffer their bias is built in within ``BUILT_VALUES`` values
(B x g x rows x Tk for blocks built g = ``BUILT_HEADS`` query heads at a time), rounded down to a
multiple of 64, between BUILT_BLOCK and QUERY_BLOCK rows, and the logits stay those of
backend="eager" whatever the block."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, patch, token_ids

from hf_posenc.attention import chunked

LENGTH = 300


@pytest.mark.parametrize("heads_at_once", [1, 4])
@pytest.mark.parametrize(
    ("budget_rows", "rows"),
    [
        (100, 128),  # below BUILT_BLOCK: BUILT_BLOCK rows
        (200, 192),  # 200 rounded down to a multiple of 64
        (10_000, 256),  # past QUERY_BLOCK: QUERY_BLOCK rows
    ],
)
def test_fire_inference_builds_its_bias_in_blocks_of_as_many_rows_as_the_budget_allows(
    monkeypatch, budget_rows, rows, heads_at_once
):
    """T=300 with L=6 (every block past L) attended ``heads_at_once`` of the 4 query heads at a
    time, the budget set to ``budget_rows`` rows of B x ``heads_at_once`` x T values: every request
    for the bias buffer asks for B x ``heads_at_once`` x ``rows`` x T values, and the logits equal
    eager's (fp32, 1e-5)."""
    assert (chunked.BUILT_BLOCK, chunked.QUERY_BLOCK) == (128, 256)  # the rows above assume them
    sizes: list[int] = []
    original = chunked.bias_scratch

    def spy(memo, size, dtype, device):
        sizes.append(size)
        return original(memo, size, dtype, device)

    monkeypatch.setattr(chunked, "bias_scratch", spy)
    models = {b: patch(make_model("llama"), "fire", {"init_L": 6.0}, backend=b) for b in ("eager", "chunked")}
    models["chunked"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    assert models["chunked"].config.num_attention_heads == 4
    monkeypatch.setattr(chunked, "BUILT_HEADS", heads_at_once)
    monkeypatch.setattr(chunked, "BUILT_VALUES", budget_rows * heads_at_once * LENGTH)
    ids = token_ids(1, LENGTH)
    with torch.no_grad():
        reference = models["eager"](ids).logits
        logits = models["chunked"](ids).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    assert sizes and set(sizes) == {heads_at_once * rows * LENGTH}, sizes
