"""``rope`` with its defaults is the checkpoint's own model, for every configuration a family's
config class accepts, or it is refused by name.

Property (hypothesis, over the config space of every registered family): for a config drawn
from the attributes the family's config class has — the number of layers, ``layer_types``
(sliding / full), a sliding window, SmolLM3-style ``no_rope_layers`` (any NoPE pattern, every
layer NoPE included), ``partial_rotary_factor`` in ``rope_parameters``, and the RoPE scalings
transformers implements (per layer type where the config nests ``rope_parameters`` by type) —
``patch_model(model, "rope")`` gives the unpatched model's logits (fp32, atol 1e-5), or
raises a one-line :class:`~hf_posenc.errors.PosencError` naming the setting it cannot
reproduce. The reference is the unpatched transformers model itself. Configs the native model
cannot run at all (a partial rotary factor with a scaled RoPE in a family whose attention
rotates the whole head: a shape error in transformers) are not drawn into the comparison.
A family whose own positions are not rotary (a learned table) gets rope on every layer.

The strategy names no family: it reads which attributes each family's ``tiny_config`` has.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, VOCAB, token_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc.core.registry import families
from hf_posenc.errors import PosencError

HIDDEN, HEADS, MAX_POSITIONS = 32, 2, 64
HEAD_DIM = HIDDEN // HEADS
LAYER_TYPES = ("sliding_attention", "full_attention")


def base_config(family: str, num_layers: int):
    return families()[family].tiny_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=num_layers,
        num_heads=HEADS,
        num_kv_heads=1,
        max_positions=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def rope_parameters(draw, theta: float, partial: float | None) -> dict:
    """One ``rope_parameters`` dict: a base theta and a scaling transformers implements."""
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    params: dict = {"rope_type": kind, "rope_theta": theta}
    if partial is not None:
        params["partial_rotary_factor"] = partial
    factor = draw(st.sampled_from([2.0, 4.0]))
    if kind in ("linear", "dynamic", "yarn"):
        params["factor"] = factor
    if kind == "yarn":
        params["original_max_position_embeddings"] = MAX_POSITIONS // 2
    if kind == "llama3":
        params.update(
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=MAX_POSITIONS // 2,
        )
    if kind == "longrope":
        half = int(HEAD_DIM * (partial or 1.0)) // 2
        params.update(
            short_factor=[1.0 + 0.25 * i for i in range(half)],
            long_factor=[2.0 + 0.5 * i for i in range(half)],
            original_max_position_embeddings=MAX_POSITIONS // 2,
        )
    return params


@st.composite
def family_configs(draw, family: str):
    """A config of ``family`` with drawn positional settings, built by its own config class
    (which validates and standardises them as it would a checkpoint's config.json)."""
    num_layers = draw(st.integers(1, 3))
    config = base_config(family, num_layers)
    changes: dict = {}
    theta = draw(st.sampled_from([100.0, 10000.0]))
    partial = draw(st.sampled_from([None, 0.5, 1.0]))
    # a config with a use_sliding_window switch (Qwen) drops the window when it is off, and
    # then has only full-attention layers
    windowed = draw(st.booleans()) if hasattr(config, "use_sliding_window") else True
    if hasattr(config, "use_sliding_window"):
        changes["use_sliding_window"] = windowed
    if getattr(config, "sliding_window", None) is not None or hasattr(config, "use_sliding_window"):
        changes["sliding_window"] = draw(st.sampled_from([4, 8]))
    if getattr(config, "layer_types", None) is not None:
        kinds = LAYER_TYPES if windowed else ("full_attention",)
        changes["layer_types"] = draw(
            st.lists(st.sampled_from(kinds), min_size=num_layers, max_size=num_layers)
        )
    if getattr(config, "no_rope_layers", None) is not None:
        changes["no_rope_layers"] = draw(
            st.lists(st.sampled_from([0, 1]), min_size=num_layers, max_size=num_layers)
        )
    existing = getattr(config, "rope_parameters", None)
    if isinstance(existing, dict) and set(existing) & set(LAYER_TYPES):  # nested by layer type
        changes["rope_parameters"] = {
            kind: draw(rope_parameters(draw(st.sampled_from([theta, theta * 100])), partial))
            for kind in existing
        }
    elif existing is not None:
        changes["rope_parameters"] = draw(rope_parameters(theta, partial))
        if "original_max_position_embeddings" in changes["rope_parameters"] and hasattr(
            config, "original_max_position_embeddings"
        ):
            changes["original_max_position_embeddings"] = changes["rope_parameters"][
                "original_max_position_embeddings"
            ]
    try:
        return type(config).from_dict({**config.to_dict(), **changes})
    except Exception:  # the config class itself refuses the combination (its own validation error)
        return None


def native_and_patched(config) -> tuple[torch.Tensor | None, torch.Tensor | PosencError]:
    """(native logits, rope-patched logits or the error the patch raised) on the same random
    weights; (None, ...) when transformers cannot run the config itself."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    ids = token_ids(1, 20)  # shorter than every original length drawn (32): no schedule switches
    with torch.no_grad():
        try:
            native = model(ids).logits
        except Exception:  # transformers cannot run this config: there is no native model to equal
            return None, PosencError("the native model does not run")
        try:
            hf_posenc.patch_model(model, "rope")
        except PosencError as error:
            return native, error
        out = model(ids).logits
        out.rope_rotations = model.posenc.layer_rotations  # which layers rotate, with what
        return native, out


@pytest.mark.slow  # ~20 model builds per family
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rope_defaults_are_the_native_model_over_the_config_space(family, data):
    config = data.draw(family_configs(family))
    if config is None:
        return
    geometry = families()[family].geometry(config)
    native, patched = native_and_patched(config)
    if native is None:
        return
    if isinstance(patched, PosencError):
        message = str(patched)
        assert "\n" not in message and ("scaling" in message or "partial_rotary_factor" in message), message
        return
    if not geometry.rotary_positions:  # positions natively from a table: rope replaces them everywhere
        assert None not in patched.rope_rotations  # type: ignore[attr-defined]
        return
    torch.testing.assert_close(patched, native, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "family, changes",
    [
        # a Llama whose rope_parameters carry a partial factor: native Llama rotates the whole head
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                }
            },
        ),
        # SmolLM3 with every layer NoPE: the native model rotates no layer
        ("smollm3", {"no_rope_layers": [0, 0]}),
        # Gemma 3 with fewer layers than its sliding pattern: every layer local (theta 10k)
        ("gemma3", {"layer_types": ["sliding_attention", "sliding_attention"]}),
    ],
)
def test_rope_defaults_are_the_native_model_in_the_configurations_found_wrong(family, changes):
    """The three configurations issue 19 found where rope's defaults were not the native model
    (5e-3, 1e-3 and 0.3 off in the logits)."""
    config = base_config(family, 2)
    config = type(config).from_dict({**config.to_dict(), **changes})
    native, patched = native_and_patched(config)
    assert native is not None and isinstance(patched, torch.Tensor)
    torch.testing.assert_close(patched, native, atol=1e-5, rtol=0)
