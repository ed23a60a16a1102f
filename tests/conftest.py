"""Tiny models built from configs (no downloads) and the encoding x family matrix."""

from __future__ import annotations

import os

import pytest
import torch
from encoding_cases import case_id, cases_of, serves
from transformers.utils import logging as hf_logging

import hf_posenc
from hf_posenc.core.registry import adapter_for, families
from hf_posenc.recipes.tiny import tiny_model

hf_logging.set_verbosity_error()
# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine under load
# their spin-waiting multiplied CPU and wall time (hf-posenc check's rows: 6-15x the CPU time
# with 2 threads). One thread here, and in the subprocesses tests start (CLI, accelerate).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

VOCAB = 101
#: every registered family (one module each in hf_posenc/models/): the ``family`` argument of
#: the shared invariant, formula-reference, drop-in and family tests runs over all of them
FAMILIES = tuple(families())
#: the families the encoding-specific files (``test_*_encodings.py``) run on, to keep CI time in
#: check: one per layout an encoding's stages see (fused projection + learned table, separate
#: projections with GQA, a sliding window on every layer). The other families differ only in
#: their projection (biases, q/k norms), which the shared tests check for every encoding kind.
ENCODING_FILE_FAMILIES = ("llama", "mistral", "gpt2")
#: families whose native model rotates q/k (RoPE): ``patch_model(m, "rope")`` must reproduce them
ROTARY_FAMILIES = tuple(
    name
    for name, adapter in families().items()
    if adapter.geometry(
        adapter.tiny_config(
            vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=8
        )
    )
    .layer(0)
    .native_rotary
)
ENCODINGS = ("nope", "sinusoidal", "learned", "t5", "alibi", "rope", "expe", "exqpe")
#: the classical encodings' cases (every encoding's are registered in tests/encoding_cases.py)
CASES = cases_of(*ENCODINGS)
#: each classical encoding with its first (default) case
DEFAULT_CASES = [next(c for c in CASES if c[0] == name) for name in ENCODINGS]


#: 1-D attention parameters make_model randomises (absent from llama, mistral and gpt2 models)
RANDOMISED_VECTORS = (
    "q_proj.bias",
    "k_proj.bias",
    "v_proj.bias",
    "q_norm.weight",
    "k_norm.weight",
)


def make_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` with random weights, in eval mode, fp32, with the family's
    test settings (``test_config_overrides``: no dropout; Mistral's sliding window of 8,
    shorter than most test inputs)."""
    overrides = {**families()[family].test_config_overrides, **overrides}
    model = tiny_model(family, vocab_size=VOCAB, max_positions=64, seed=seed, **overrides)
    # larger weights than the default init make positional effects visible in logits; q/k/v
    # biases and q/k norm gains (zeros and ones at init) get random values too, so the
    # references see them act
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith(RANDOMISED_VECTORS):
                p.normal_(1.0 if "norm" in name else 0.0, 0.15)
    return model


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` in layer order."""
    return adapter_for(model).attention_modules(model)


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


def _one_rotation(name: str) -> bool:
    """Whether plain ``rope`` on the family's test model is one RoPE (one theta) on every layer:
    not Gemma 3 (two thetas) nor SmolLM3 (NoPE layers), where rope follows each layer."""
    adapter = families()[name]
    config = adapter.tiny_config(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64
    )
    geometry = adapter.geometry(config)
    layers = [geometry.layer(i) for i in range(geometry.num_layers)]
    return len({(layer.rope_theta, layer.native_rotary) for layer in layers}) == 1


#: families whose plain ``rope`` rotates every layer alike: the tests that an encoding "starts as
#: rope" (liere, rope2d, comrope use one theta on every layer) run on these
ONE_ROTATION_FAMILIES = tuple(name for name in FAMILIES if _one_rotation(name))


def _parametrised_here(metafunc: pytest.Metafunc, argname: str) -> bool:
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if argname in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``family`` and the shared ``case`` (unless the test or its module does):
    ``family`` runs on every family, or on ENCODING_FILE_FAMILIES in the encoding-specific
    files; with ``case``, every variant of CASES runs on ENCODING_FILE_FAMILIES and each encoding
    with its defaults on the other families (the variants exercise encoding code, not family code)."""
    wants_family = "family" in metafunc.fixturenames and not _parametrised_here(metafunc, "family")
    wants_case = (
        "case" in metafunc.fixturenames
        and not _parametrised_here(metafunc, "case")
        and not hasattr(metafunc.module, "case")  # a module's own ``case`` fixture
    )
    # the encoding-specific modules (test_relative_bias_encodings.py, ...) are named by subject
    encoding_file = metafunc.module.__name__.endswith(("_encodings", "_encoding"))
    if wants_family and wants_case:
        pairs = [
            (name, case)
            for name in (ENCODING_FILE_FAMILIES if encoding_file else FAMILIES)
            for case in (CASES if name in ENCODING_FILE_FAMILIES else DEFAULT_CASES)
            if serves(name in ROTARY_FAMILIES, case)
        ]
        metafunc.parametrize(("family", "case"), pairs, ids=[f"{f}-{case_id(c)}" for f, c in pairs])
    elif wants_family:
        metafunc.parametrize("family", ENCODING_FILE_FAMILIES if encoding_file else FAMILIES)
    elif wants_case:
        metafunc.parametrize("case", CASES, ids=[case_id(c) for c in CASES])


#: encodings covering every stage kind for the drop-in checks: rotary, score bias, learned bias,
#: layer input, MLP bias, stateful score bias, layer stream
DROPIN_ENCODINGS = ("rope", "alibi", "t5", "expe", "fire", "fox", "tape")


def no_grad_logits(model, ids, **kwargs) -> torch.Tensor:
    """The model's logits for ``ids`` without recording gradients."""
    with torch.no_grad():
        return model(ids, **kwargs).logits


def decoded_and_full_logits(model, ids: torch.Tensor, prompt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step of decoding ``ids`` (B, T) after a ``prompt``-token prefill into a DynamicCache, token
    by token: (the step's last logits, a full forward's last logits over the same prefix), for
    the prefixes of ``prompt`` .. T tokens; without gradients."""
    from transformers import DynamicCache

    pairs = []
    with torch.no_grad():
        out = model(ids[:, :prompt], past_key_values=DynamicCache(config=model.config), use_cache=True)
        for t in range(prompt, ids.shape[1] + 1):
            if t > prompt:
                out = model(ids[:, t - 1 : t], past_key_values=out.past_key_values, use_cache=True)
            pairs.append((out.logits[:, -1], model(ids[:, :t]).logits[:, -1]))
    return pairs


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def run_two_processes(script, *args: str, **env: str):
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 script *args`` from the
    repository root (one torch thread per process, ``env`` added), asserting it exits 0; returns
    the finished process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*command, str(script), *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result
