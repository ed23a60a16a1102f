"""Blocks whose bias is written out (FIRE past its threshold L) without gradients: they run
BUILT_BLOCK queries at a time, so the one buffer the blocks' bias is built in holds half the
values a QUERY_BLOCK block would, and the logits stay those of backend="eager"."""

from __future__ import annotations

import torch
from conftest import make_model, patch, token_ids

from hf_posenc.attention import chunked


def test_fire_inference_builds_its_bias_in_a_buffer_of_built_block_rows(monkeypatch):
    """T=300 with L=6 (every block past L): each request for the bias buffer asks for
    B x Hq x BUILT_BLOCK x T values (not QUERY_BLOCK rows), and the logits equal eager's (fp32,
    1e-5)."""
    sizes: list[int] = []
    original = chunked.bias_scratch

    def spy(memo, size, dtype, device):
        sizes.append(size)
        return original(memo, size, dtype, device)

    monkeypatch.setattr(chunked, "bias_scratch", spy)
    models = {b: patch(make_model("llama"), "fire", {"init_L": 6.0}, backend=b) for b in ("eager", "chunked")}
    models["chunked"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    ids = token_ids(1, 300)
    with torch.no_grad():
        reference = models["eager"](ids).logits
        logits = models["chunked"](ids).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    heads = models["chunked"].config.num_attention_heads
    assert chunked.BUILT_BLOCK < chunked.QUERY_BLOCK
    assert sizes and set(sizes) == {heads * chunked.BUILT_BLOCK * 300}, sizes
