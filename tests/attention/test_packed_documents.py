"""Packed documents: a batch of several documents per row, with position ids restarting at each
document (transformers' padding-free convention), gives every document exactly what it gets
alone — logits, loss and gradients — for every encoding on every backend; the chunked backend
skips the key blocks of earlier documents instead of computing and masking them."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from encoding_cases import ALL_CASES, case_ids
from packing_cases import documents, packed, patched

from hf_posenc.attention import bias_block, chunked

#: two rows of documents (lengths): documents of 1 token, documents that cross query blocks of
#: 4, and a row that is one document
ROWS = ([3, 9, 1, 7], [20])
#: auto (chunked for score biases on CPU, SDPA otherwise) in the quick suite, each backend by name in CI
GRAD_BACKENDS = ("auto", *(pytest.param(b, marks=pytest.mark.slow) for b in ("eager", "sdpa", "chunked")))


@pytest.fixture(autouse=True)
def small_query_blocks(monkeypatch):
    """Query blocks of 4, so the 20-token rows are several blocks (chunked and rows backends)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
@pytest.mark.parametrize("case", ALL_CASES, ids=case_ids(ALL_CASES))
def test_packed_loss_and_gradients_equal_the_documents_one_at_a_time(case, backend):
    """sum of token losses over the packed batch == the sum of each document's token losses,
    computed alone; the same for the gradients of every parameter."""
    name, params = case
    rows = documents(ROWS)
    model = patched(name, params, backend)
    labels = sum(len(d) - 1 for row in rows for d in row)
    loss = model(**packed(rows), use_cache=False, num_items_in_batch=labels).loss
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    expected = torch.zeros(())
    for doc in (d for row in rows for d in row):
        if len(doc) > 1:
            alone = model(input_ids=doc[None], labels=doc[None], use_cache=False).loss * (len(doc) - 1)
            alone.backward()
            expected = expected + alone.detach()
    expected = expected / labels
    assert torch.allclose(loss.detach(), expected, atol=1e-5, rtol=1e-5), (loss.item(), expected.item())
    for n, p in model.named_parameters():
        if p.grad is None:
            assert n not in got
            continue
        reference = p.grad / labels
        assert torch.allclose(got[n], reference, atol=1e-5, rtol=1e-4), n


@pytest.mark.slow  # 40 uncompiled FlexAttention forwards; CI runs it
@pytest.mark.parametrize("case", ALL_CASES, ids=case_ids(ALL_CASES))
def test_packed_logits_equal_the_documents_alone_under_flex(case):
    """backend="flex" (uncompiled off CUDA, no backward there): the logits of every document."""
    name, params = case
    rows = documents(ROWS, seed=2)
    model = patched(name, params, "flex").eval()
    with torch.no_grad():
        batch = packed(rows)
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        for r, row in enumerate(rows):
            alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in row])
            assert torch.allclose(logits[r], alone, atol=1e-4), r


def test_chunked_backend_skips_the_keys_of_earlier_documents(monkeypatch):
    """Each SDPA call of a query block (:func:`~hf_posenc.attention.bias_block.block_attention`) gets
    only the keys from the block's first document on."""
    keys: list[int] = []
    sdpa = bias_block.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        keys.append(k.shape[-2])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(bias_block.F, "scaled_dot_product_attention", spy)
    model = patched("alibi", {}, "chunked").eval()
    lengths = [6, 10]  # blocks of 4 queries: [0,4) [4,8) [8,12) [12,16); document 2 starts at 6
    ids = torch.randint(3, VOCAB, (1, 16))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    layers = model.config.num_hidden_layers
    # keys from 0 (blocks 1-2: the first document is in them) or 6 (blocks 3-4) to the block's end
    assert keys == [4, 8, 12 - 6, 16 - 6] * layers
