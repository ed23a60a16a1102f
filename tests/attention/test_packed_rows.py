"""Packed documents on the ``rows`` backend (CoPE, CAPE, SBA: explicit scores one block of queries at
a time): each block's keys start at its first document, the keys of earlier documents are skipped,
and every document gets what it gets alone on the eager backend — logits and gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from encoding_cases import case_ids, cases_of
from packing_cases import documents, packed, patched

import hf_posenc
from hf_posenc.attention import chunked

#: + CAPE over FIRE with a threshold below the documents' lengths, so its bias reads each query's
#: position (two blocks of skipped keys can have the same shape and different positions)
ROW_CASES = [
    *cases_of("cope", "cape", "sba"),
    ("cape", {"base": "fire", "base_params": {"init_L": 2.0}, "hidden": 8}),
]
#: two rows whose document starts differ, so blocks of 4 queries start at keys 0, 0, 3, 11, 11
#: (the earliest document start of the block over both rows): skipping happens, and it is
#: bounded by the row whose document started first
ROWS = ([3, 9, 1, 7], [6, 5, 9])
ATOL = 1e-5


@pytest.fixture(autouse=True)
def small_query_blocks(monkeypatch):
    """Query blocks of 4: the 20-token rows are five blocks and the rows backend serves them."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 4)


@pytest.mark.parametrize("case", ROW_CASES, ids=case_ids(ROW_CASES))
def test_packed_rows_equal_each_document_alone_under_eager(case, monkeypatch):
    """Packed (position ids restarting per document) on the rows backend: the logits of every
    document and the gradient of every parameter of sum(logits * weights) equal the eager
    backend's on each document alone; and the rows backend served the packed call."""
    name, params = case
    rows = documents(ROWS)
    packed_model, eager_model = patched(name, params, "chunked"), patched(name, params, "eager")
    for (n, a), (_, b) in zip(packed_model.named_parameters(), eager_model.named_parameters(), strict=True):
        assert torch.equal(a, b), n  # the same weights

    served: list[str] = []
    for backend in hf_posenc.attention.registered_backends():

        def spy(call, backend=backend, original=backend.attend):
            served.append(backend.name)
            return original(call)

        monkeypatch.setattr(backend, "attend", spy)
    batch = packed(rows)
    ids, positions = batch["input_ids"], batch["position_ids"]
    weights = torch.randn(ids.shape[0], ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(3))
    logits = packed_model(input_ids=ids, position_ids=positions, use_cache=False).logits
    (logits * weights).sum().backward()
    assert served and set(served) == {"rows"}, served

    for r, row in enumerate(rows):
        offset = 0
        for doc in row:
            alone = eager_model(input_ids=doc[None], use_cache=False).logits[0]
            part = slice(offset, offset + len(doc))
            torch.testing.assert_close(logits[r, part].detach(), alone.detach(), atol=ATOL, rtol=0)
            (alone * weights[r, part]).sum().backward()
            offset += len(doc)
    largest: dict[str, float] = {}  # per module, its parameters' largest gradient entry
    for n, e in eager_model.named_parameters():
        if e.grad is not None:
            module = n.rpartition(".")[0]
            largest[module] = max(largest.get(module, 0.0), e.grad.abs().max().item())
    for (n, p), (_, e) in zip(packed_model.named_parameters(), eager_model.named_parameters(), strict=True):
        assert (p.grad is None) == (e.grad is None), n
        if p.grad is not None:
            # fp32 sums over different key counts: within 1e-5 of the gradient's largest entry (or
            # of 1); a gradient that is 0 but for rounding (CAPE's output bias shifts whole rows)
            # is rounding of sums as large as its module's other gradients: 1e-5 of their largest
            scale = max(1.0, e.grad.abs().max().item())
            if e.grad.abs().max().item() < 1e-3:
                scale = max(scale, largest[n.rpartition(".")[0]])
            torch.testing.assert_close(p.grad, e.grad, atol=1e-5 * scale, rtol=1e-4, msg=n)


def test_rows_backend_skips_the_keys_of_earlier_documents(monkeypatch):
    """Each query block's explicit scores cover only the keys from the block's first document on."""
    keys: list[int] = []
    explicit = hf_posenc.attention.rows.attend_explicit

    def spy(call, score, v, mask, bias):
        assert score.k.shape[-2] == v.shape[-2] == mask.shape[-1]
        keys.append(score.k.shape[-2])
        return explicit(call, score, v, mask, bias)

    monkeypatch.setattr(hf_posenc.attention.rows, "attend_explicit", spy)
    model = patched("sba", {}, "chunked").eval()
    lengths = [6, 10]  # blocks of 4 queries: [0,4) [4,8) [8,12) [12,16); document 2 starts at 6
    ids = torch.randint(3, VOCAB, (1, 16))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
    # keys from 0 (blocks 1-2: the first document is in them) or 6 (blocks 3-4) to the block's end
    assert keys == [4, 8, 12 - 6, 16 - 6] * model.config.num_hidden_layers
