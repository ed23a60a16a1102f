"""What the packed-document tests share: random documents of given lengths, the padding-free
batch written from transformers' convention, and a patched tiny Llama with trained-looking
encoding parameters."""

from __future__ import annotations

import torch
from conftest import VOCAB, make_model

import hf_posenc


def documents(rows: tuple[list[int], ...], seed: int = 0) -> list[list[torch.Tensor]]:
    """Per row, one random document of each length in ``rows``."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, VOCAB, (n,), generator=generator) for n in row] for row in rows]


def packed(rows: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The padding-free batch, written from the convention: ids concatenated per row, positions
    0..n-1 per document, each document's first token not a label."""
    ids = torch.stack([torch.cat(row) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in rows])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def patched(name: str, params: dict, backend: str) -> torch.nn.Module:
    """A tiny Llama patched with ``name`` on ``backend``, its encoding parameters (zero-initialised
    ones included) moved off their initial values, in train mode."""
    model = make_model("llama")
    hf_posenc.patch_model(model, name, backend=backend, **params)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.posenc.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.train()
