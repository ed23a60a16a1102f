"""A model family is one registered module in hf_posenc/models/: every family is in the test
matrix, its adapter's facts match the model transformers builds, unsupported features are
refused by name, and nothing outside models/ names a family (nor outside encodings/ an encoding)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    FAMILIES,
    ONE_ROTATION_FAMILIES,
    ROTARY_FAMILIES,
    attention_modules,
    make_model,
    patch,
    token_ids,
)
from references.config import native_window

import hf_posenc
from hf_posenc import UnsupportedModelError
from hf_posenc.core.registry import families

PACKAGE = Path(hf_posenc.__file__).parent
MODELS = PACKAGE / "models"


def family_files() -> list[str]:
    """Family modules as files on disk: every module in models/ except the shared base and the registry."""
    return sorted(
        p.stem
        for p in MODELS.glob("*.py")
        if p.stem not in ("__init__", "base", "registry") and not p.stem.startswith("_")
    )


def test_every_family_module_is_registered_and_in_the_test_matrix():
    """Each file in models/ registers one adapter named after the file, and the test suite's
    FAMILIES (which the shared invariant tests are parametrised over) holds every one."""
    adapters = families()
    assert sorted(adapters) == family_files()
    assert sorted(FAMILIES) == family_files()
    for name, adapter in adapters.items():
        assert adapter.family == name
        assert adapter.model_types, name
        assert type(adapter).__module__ == f"hf_posenc.models.{name}"
    served = [t for adapter in adapters.values() for t in adapter.model_types]
    assert sorted(served) == hf_posenc.supported_families()


def test_tiny_model_of_each_family_matches_its_adapter(family):
    """The tiny model is served by the family's adapter, and the adapter's geometry agrees with
    what transformers built: one attention module per layer, each with the softmax scale and
    sliding window its config gives it."""
    model = make_model(family)
    adapter = families()[family]
    assert model.config.model_type in adapter.model_types
    adapter.check_supported(model)  # the family's own tiny model is supported
    geometry = adapter.geometry(model.config)
    attention = attention_modules(model)
    assert len(attention) == geometry.num_layers
    for index, module in enumerate(attention):
        layer = geometry.layer(index)
        assert layer.softmax_scale == pytest.approx(module.scaling)
        assert layer.sliding_window == native_window(model, index)
        assert module.head_dim == geometry.head_dim
    for target in adapter.lora_targets:  # every default LoRA target exists in the model
        assert any(name.endswith("." + target) for name, _ in model.named_modules()), target


def _subclass_attention(model) -> None:
    """Stand-in for an attention subclass (e.g. remote code) that defines its own forward."""
    for module in attention_modules(model):
        module.__class__ = type("CustomAttention", (type(module),), {"forward": type(module).forward})


def _add_q_norm(model) -> None:
    for module in attention_modules(model):
        module.q_norm = torch.nn.LayerNorm(module.head_dim)


def _remove_rotary(model) -> None:
    del model.model.rotary_emb


def _remove_k_norm(model) -> None:
    for module in attention_modules(model):
        del module.k_norm


#: (family, config overrides, model edit, text the refusal must contain)
REFUSALS = [
    ("llama", {"attn_logit_softcapping": 50.0}, None, "attn_logit_softcapping=50.0"),
    ("llama", {"final_logit_softcapping": 30.0}, None, "final_logit_softcapping=30.0"),
    ("llama", {"embedding_multiplier": 12.0}, None, "embedding_multiplier=12.0"),
    ("llama", {"query_pre_attn_scalar": 256}, None, "query_pre_attn_scalar=256"),
    ("llama", {"no_rope_layers": [1, 0]}, None, "no_rope_layers=[1, 0]"),
    ("mistral", {"attn_logit_softcapping": 50.0}, None, "attn_logit_softcapping=50.0"),
    ("mistral", {"scale_embedding": True}, None, "scale_embedding=True"),
    ("llama", {}, _add_q_norm, "q/k norm module='q_norm'"),
    ("mistral", {}, _add_q_norm, "q/k norm module='q_norm'"),
    ("llama", {}, _subclass_attention, "attention class='CustomAttention'"),
    ("mistral", {}, _subclass_attention, "attention class='CustomAttention'"),
    ("gpt2", {}, _subclass_attention, "attention class='CustomAttention'"),
    ("llama", {}, _remove_rotary, "decoder stack without rotary_emb"),
    ("gpt2", {"attn_logit_softcapping": 50.0}, None, "attn_logit_softcapping=50.0"),
    ("qwen2", {"attn_logit_softcapping": 50.0}, None, "attn_logit_softcapping=50.0"),
    ("qwen2", {}, _add_q_norm, "q/k norm module='q_norm'"),
    ("qwen3", {}, _remove_k_norm, "qk_norm='head' attention without='q_norm/k_norm'"),
    ("qwen3", {}, _subclass_attention, "attention class='CustomAttention'"),
    ("olmo2", {}, _remove_k_norm, "qk_norm='projection' attention without='q_norm/k_norm'"),
    ("olmo2", {"embedding_multiplier": 12.0}, None, "embedding_multiplier=12.0"),
]


@pytest.mark.parametrize(
    ("family", "overrides", "edit", "feature"), REFUSALS, ids=[f"{r[0]}-{r[3]}" for r in REFUSALS]
)
def test_check_supported_refuses_each_unsupported_feature_by_name(family, overrides, edit, feature):
    """A model of a supported model_type with a feature the adapter does not reproduce is
    refused before anything changes, in one line naming the feature and its value."""
    model = make_model(family, **overrides)
    if edit is not None:
        edit(model)
    ids = token_ids(1, 6)
    with pytest.raises(UnsupportedModelError) as info:
        hf_posenc.patch_model(model, "alibi")
    message = str(info.value)
    assert feature in message and family in message and "\n" not in message
    assert not hasattr(model, "posenc") and hf_posenc.patch_info(model) is None
    if edit is None:  # the model still runs natively
        with torch.no_grad():
            model(ids)


@pytest.mark.parametrize("family", [f for f in ROTARY_FAMILIES if f in ONE_ROTATION_FAMILIES])
def test_rope_with_the_models_own_settings_reproduces_the_native_model(family):
    """``patch_model(m, "rope")`` on a family whose native model uses RoPE gives its native
    logits (fp32, atol 1e-5), with and without left padding: the projection (biases, q/k norms),
    the rotation and the attention are the family's own. (Families whose layers rotate differently,
    Gemma 3's two thetas and SmolLM3's NoPE layers, are checked against their native models with
    their own per-layer settings in test_families_gemma3_phi3_smollm3.py.)"""
    model = make_model(family, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    ids = token_ids(2, 14)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        native = model(ids).logits
        native_padded = model(ids, attention_mask=mask).logits
        patch(model, "rope", randomize=False)
        assert hf_posenc.patch_info(model)["params"]["theta"] == 500.0
        patched = model(ids).logits
        patched_padded = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(patched, native, atol=1e-5, rtol=0)
    torch.testing.assert_close(patched_padded[0], native_padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(patched_padded[1, 3:], native_padded[1, 3:], atol=1e-5, rtol=0)


#: one encoding per kind of attention work: rotary (plain core), block score bias, learned
#: per-layer score bias, layer input, stateful data-dependent bias
BACKEND_ENCODINGS = ("rope", "alibi", "t5", "expe", "fox")


@pytest.mark.slow  # multi-second; CI runs it
@pytest.mark.parametrize("name", BACKEND_ENCODINGS)
def test_every_backend_equals_eager_on_every_family(family, name):
    """The sdpa, chunked, flex and auto backends give the eager reference's logits (atol 1e-5)
    on every family, on a left-padded batch."""
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    results = {}
    for backend in ("eager", "sdpa", "chunked", "flex", "auto"):
        model = patch(make_model(family), name, backend=backend)  # same seeds: same weights
        with torch.no_grad():
            results[backend] = model(ids, attention_mask=mask).logits
    for backend, logits in results.items():
        torch.testing.assert_close(logits[0], results["eager"][0], atol=1e-5, rtol=0, msg=backend)
        torch.testing.assert_close(logits[1, 4:], results["eager"][1, 4:], atol=1e-5, rtol=0, msg=backend)


def _non_docstring_strings(tree: ast.AST) -> list[ast.Constant]:
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_nothing_outside_models_names_a_family():
    """No module outside hf_posenc/models/ has a family name or model_type as a word in a
    string (docstrings aside), nor imports a family module: family facts live in the family."""
    names = set(FAMILIES) | {t for adapter in families().values() for t in adapter.model_types}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if MODELS in path.parents:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _non_docstring_strings(tree):
            hits = names & set(re.findall(r"[A-Za-z0-9_]+", node.value))
            if hits:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {sorted(hits)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] in names:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {node.module}")
    assert not offenders, offenders


#: aliases that are ordinary words of prose and option values ("none", "exact", "relative"): never
#: read as naming an encoding; "learned" is read as one only where a string is exactly that word
ENGLISH_ALIASES = frozenset({"none", "exact", "relative", "absolute", "contextual", "rotary"})
PROSE_NAMES = frozenset({"learned"})
#: where naming encodings is the point, with the names each place may use
ENCODING_NAME_EXCEPTIONS = {
    # the public face re-exports every encoding's config class (``hf_posenc.ALiBiConfig``, ...)
    "__init__.py": None,
    # flash-linear-attention's stick-breaking kernel is the kernel of the ``sba`` encoding
    "attention/kernels.py": {"sba"},
    # usage examples in help and error texts (``--encoding rope*3+nope``, ``e.g. alibi``)
    "core/pattern.py": {"rope", "nope"},
    "recipes/cli/common.py": {"rope", "nope"},
    "recipes/cli/inspect.py": {"rope", "nope"},
    "recipes/cli/lm_eval.py": {"alibi", "expe", "rope"},
    "recipes/cli/model_plan.py": {"alibi"},
    "recipes/cli/study.py": {
        "alibi",
        "expe",
        "exqpe",
        "nope",
        "rope",
        "sinusoidal",
        "t5",
        "selfextend",
        "rerope",
    },
    "recipes/evaluation/perplexity.py": {"alibi"},
    "recipes/training/s2.py": {"rope"},
    "recipes/benchmark/s2_attn.py": {
        "rope"
    },  # LongLoRA's speed benchmark fine-tunes a RoPE model  # --s2-attn on a native checkpoint: "add --encoding rope"
    # the study's default settings: the encodings the ExPE paper compares, its evaluation-only rows
    "recipes/study/spec.py": {"alibi", "expe", "exqpe", "nope", "rope", "sinusoidal", "t5"},
    "recipes/study/evaluate.py": {"expe", "exqpe", "rope", "selfextend"},
}


def test_nothing_outside_encodings_names_an_encoding():
    """No module outside hf_posenc/encodings/ has an encoding's name or alias as a word in a string
    (docstrings aside), nor imports an encoding's module: what an encoding is and refuses (its
    position limit, whether it may run in some layers only, its scaling) is asked of the encoding.
    The places where naming encodings is the point are listed in ``ENCODING_NAME_EXCEPTIONS``."""
    listing = hf_posenc.list_encodings()
    names = (
        {info.name for info in listing} | {alias for info in listing for alias in info.aliases}
    ) - ENGLISH_ALIASES
    encodings = PACKAGE / "encodings"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if encodings in path.parents:
            continue
        where = str(path.relative_to(PACKAGE))
        allowed = ENCODING_NAME_EXCEPTIONS.get(where, set())
        if allowed is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _non_docstring_strings(tree):
            words = set(re.findall(r"[A-Za-z0-9_]+", node.value))
            hits = (names - PROSE_NAMES) & words | (PROSE_NAMES & {node.value.strip()})
            if hits - allowed:
                offenders.append(f"{where}:{node.lineno} {sorted(hits - allowed)}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[-1] in names - allowed
            ):
                offenders.append(f"{where}:{node.lineno} imports {node.module}")
    assert not offenders, offenders
