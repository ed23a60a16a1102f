"""``Encoding.reads_positions`` (and an instance's ``reads_position_ids()``) says whether the attention depends on the position ids a caller
passes: checked against what the model does, for every encoding case — the logits change when
the ids skip forward in the middle of the sequence (as PoSE's do) exactly when it says True."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, make_model
from encoding_cases import ALL_CASES, case_ids

import hf_posenc
from hf_posenc.core.limits import position_limit
from hf_posenc.core.registry import get_encoding


@pytest.mark.parametrize("case", ALL_CASES, ids=case_ids(ALL_CASES))
def test_reads_positions_is_whether_skipped_position_ids_change_the_logits(case):
    name, params = case
    model = make_model("llama")
    hf_posenc.patch_model(model, name, **params)
    torch.manual_seed(0)
    with torch.no_grad():  # trained-looking parameters (zero-initialised tables would hide a reader)
        for parameter in model.posenc.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        ids = torch.randint(3, VOCAB, (1, 16))
        mask = torch.ones_like(ids)  # no packed-document detection from the skipped ids
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        # a short skip, and one past FIRE's default threshold L = 512 where the model allows it
        limit = position_limit(model)
        skips = [9] + ([600] if limit is None or limit[0] > 616 else [])
        changed = False
        for skip in skips:
            skipped = torch.cat([torch.arange(6), torch.arange(6, 16) + skip])[None]
            moved = model(input_ids=ids, attention_mask=mask, position_ids=skipped, use_cache=False).logits
            changed = changed or not torch.allclose(plain, moved, atol=1e-5)
    assert model.posenc.reads_position_ids() == changed
    if not params:  # the class attribute speaks for the defaults
        assert get_encoding(name).reads_positions == changed
