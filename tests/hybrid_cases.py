"""Shared helper of the per-layer hybrid tests (tests/core/test_hybrid*.py): mixed patterns on a
4-layer model, each with the encoding of every layer and the parameters per encoding."""

from __future__ import annotations

import torch
from conftest import make_model

import hf_posenc

ATOL = 1e-5
LAYERS = 4
#: mixed patterns: (request, the encoding of every layer of a 4-layer model, params per encoding)
MIXED = {
    "rope/nope": (["rope", "nope"], ["rope", "nope", "rope", "nope"], {}),
    "alibi/rope/nope": ("alibi+rope+nope", ["alibi", "rope", "nope", "alibi"], {}),
    "t5/fox": (
        [("t5", {"shared_across_layers": False, "num_buckets": 8}), "fox"],
        ["t5", "fox", "t5", "fox"],
        {"t5": {"shared_across_layers": False, "num_buckets": 8}},
    ),
    "explicit": (
        {"default": "alibi", 1: ("rope", {"theta": 500.0}), 2: hf_posenc.KERPLEConfig()},
        ["alibi", "rope", "kerple", "alibi"],
        {"rope": {"theta": 500.0}},
    ),
}


def four_layer_model(family: str = "llama"):
    return make_model(family, num_layers=LAYERS)


def randomize(module: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def hybrid(name: str, family: str = "llama", **kwargs):
    request, _, _ = MIXED[name]
    model = four_layer_model(family)
    hf_posenc.patch_model(model, request, **kwargs)
    randomize(model.posenc)
    return model
