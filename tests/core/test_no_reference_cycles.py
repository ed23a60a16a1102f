"""A forward without gradients leaves no reference cycles: everything a layer made is freed when
the layer is done with it, not when Python's cyclic collector next runs. A cycle through a layer's
call (a nested function that calls itself, closing over the call's q and k) kept every layer's q
and k alive until then, so the inference peak grew with depth (SelfExtend and the ReRoPE pair
until 2026-11-27: 5.2 -> 8.2 KiB per token from 3 to 7 layers of the 64-wide test model).
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import make_model, patch, token_ids
from encoding_cases import CASES_BY_ENCODING


@pytest.mark.parametrize("name", sorted(CASES_BY_ENCODING))
def test_a_forward_without_gradients_leaves_no_reference_cycles(name):
    model = patch(make_model("llama"), name, CASES_BY_ENCODING[name][0][1])
    ids = token_ids(2, 40)
    with torch.no_grad():
        model(ids, use_cache=False)  # first-call caches (compiled kernels, tables) made here
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
        gc.set_debug(gc.DEBUG_SAVEALL)
        found = gc.collect()
        garbage = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert found == 0, f"{name}: {found} objects in reference cycles: {garbage}"
