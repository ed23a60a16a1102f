"""Tiny models built from configs (no downloads) and the encoding x family matrix."""

from __future__ import annotations

import os

import pytest
import torch
from encoding_cases import case_id, cases_of
from transformers.utils import logging as hf_logging

import hf_posenc
from hf_posenc.registry import adapter_for, families
from hf_posenc.tiny import tiny_model

hf_logging.set_verbosity_error()
# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine under load
# their spin-waiting multiplied CPU and wall time (hf-posenc check's rows: 6-15x the CPU time
# with 2 threads). One thread here, and in the subprocesses tests start (CLI, accelerate).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 101
#: every registered family (one module each in hf_posenc/models/): each is exercised by the
#: tests parametrised over FAMILIES
FAMILIES = tuple(families())
ENCODINGS = ("nope", "sinusoidal", "learned", "t5", "alibi", "rope", "expe", "exqpe")
#: the classical encodings' cases (every encoding's are registered in tests/encoding_cases.py)
CASES = cases_of(*ENCODINGS)


def make_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` with random weights, in eval mode, fp32, with the family's
    test settings (``test_config_overrides``: no dropout; Mistral's sliding window of 8,
    shorter than most test inputs)."""
    overrides = {**families()[family].test_config_overrides, **overrides}
    model = tiny_model(family, vocab_size=VOCAB, max_positions=64, seed=seed, **overrides)
    # larger weights than the default init make positional effects visible in logits
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` in layer order."""
    return adapter_for(model).attention_modules(model)


def native_window(model: torch.nn.Module, layer: int = 0) -> int | None:
    """The sliding window of ``layer`` as the config states it (``layer_types`` when present)."""
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def num_query_heads(model: torch.nn.Module) -> int:
    """Query heads per layer, as the config states them."""
    config = model.config
    return getattr(config, "num_attention_heads", None) or config.n_head


def randomize_encoding(model: torch.nn.Module, seed: int = 1) -> None:
    """Give the encoding's parameters random values (they start at zero for t5/learned)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.posenc.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def patch(model, name: str, params: dict | None = None, randomize: bool = True, **kwargs):
    hf_posenc.patch_model(model, name, **(params or {}), **kwargs)
    if randomize:
        randomize_encoding(model)
    return model


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(params=CASES, ids=[case_id(c) for c in CASES])
def case(request):
    return request.param


#: encodings covering every stage kind for the drop-in checks: rotary, score bias, learned bias,
#: layer input, MLP bias, stateful score bias, layer stream
DROPIN_ENCODINGS = ("rope", "alibi", "t5", "expe", "fire", "fox", "tape")


def no_grad_logits(model, ids, **kwargs) -> torch.Tensor:
    """The model's logits for ``ids`` without recording gradients."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)
