"""``--loss chunked``: the cross-entropy without (tokens x vocabulary) logits equals the full one,
in value and in every gradient, for plain inputs and packed ones; families whose logits are
not a plain ``lm_head(hidden)`` are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training.loss import chunked_cross_entropy, loss_function


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 40),
    vocab=st.integers(2, 30),
    chunk=st.integers(1, 50),
    with_bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_chunked_cross_entropy_is_the_summed_cross_entropy(tokens, vocab, chunk, with_bias, seed):
    """sum over non-ignored tokens of -log softmax(h W^T + b)[target], and its gradients in h, W, b,
    against torch's full cross_entropy over the whole logits."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(vocab, 8, generator=generator, dtype=torch.float64).requires_grad_()
    bias = (
        torch.randn(vocab, generator=generator, dtype=torch.float64).requires_grad_() if with_bias else None
    )
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[torch.rand(tokens, generator=generator) < 0.3] = -100
    reference = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=-100, reduction="sum")
    expected = torch.autograd.grad(reference, [t for t in (hidden, weight, bias) if t is not None])
    # the chunked loss upcasts each chunk's logits to fp32, as transformers' loss does
    got = chunked_cross_entropy(hidden, weight, bias, targets, chunk)
    grads = torch.autograd.grad(got, [t for t in (hidden, weight, bias) if t is not None], allow_unused=True)
    torch.testing.assert_close(got.double(), reference, atol=1e-4, rtol=1e-5)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(torch.zeros_like(b) if a is None else a, b, atol=1e-4, rtol=1e-4)


def _inputs(packed: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(0))
    if not packed:
        return {"input_ids": ids, "labels": ids}
    positions = torch.cat([torch.arange(n) for n in (5, 11, 8)]).expand(2, -1)
    labels = ids.masked_fill(positions == 0, -100)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "labels": labels,
        "use_cache": False,
        "num_items_in_batch": 17.5,  # a share of a step's labels, as the packing feed passes it
    }


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("packed", [False, True], ids=["blocks", "packed"])
def test_chunked_loss_equals_the_models_own_loss_and_gradients(family, packed, monkeypatch):
    """loss_function("chunked") (chunks of 7 tokens) == the model's own (full-logits) loss."""
    from hf_posenc.recipes.training import loss as loss_module

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 7 * 128)  # 7 tokens of the 128-token vocabulary
    model = tiny_model(family, vocab_size=128, max_positions=64)
    hf_posenc.patch_model(model, "alibi")
    model.eval()  # no dropout: both losses see the same network (gradients flow all the same)
    results = []
    for kind in ("full", "chunked"):
        model.zero_grad()
        loss = loss_function(kind, model)(model, _inputs(packed))
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (full, full_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert full_grads.keys() == chunked_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_family_with_soft_capped_logits_is_refused_in_one_line():
    model = tiny_model("gemma3", vocab_size=64, max_positions=32)
    with pytest.raises(InvalidParameterError, match=r"--loss chunked is not allowed.*allowed: --loss full"):
        loss_function("chunked", model)


def test_an_unknown_loss_is_refused():
    from hf_posenc.recipes.training import TrainConfig

    with pytest.raises(InvalidParameterError, match="loss='fused'.*allowed: full, chunked"):
        TrainConfig(model="m", output_dir="o", loss="fused")
