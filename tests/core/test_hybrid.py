"""Per-layer hybrid encodings (``patch_model(model, ["rope", "rope", "rope", "nope"])``).

References: transformers' own ``SmolLM3ForCausalLM`` (NoPE every 4th layer) for rope/nope, and
for any mix, each layer of the hybrid against the same layer of a model patched plainly with that
layer's encoding (holding the same tensors), fed the same input.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import no_grad_logits, token_ids
from hybrid_cases import ATOL, LAYERS, MIXED, four_layer_model, hybrid
from transformers import LlamaConfig, LlamaForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

import hf_posenc
from hf_posenc.errors import AlreadyPatchedError, InvalidParameterError

# -- the peer: SmolLM3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_form",
    [["rope", "rope", "rope", "nope"], "rope*3+nope", {"default": "rope", 3: "nope", 7: "nope"}],
    ids=["list", "text", "explicit"],
)
def test_rope3_nope_pattern_reproduces_smollm3(request_form):
    """A Llama checkpoint patched with rope x3 + nope gives SmolLM3ForCausalLM's logits for the same
    weights and no_rope_layers (transformers' own NoPE-every-4th-layer model)."""
    shape = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    smol = SmolLM3ForCausalLM(SmolLM3Config(**shape, no_rope_layer_interval=4)).eval()
    assert smol.config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]  # guard: the peer really mixes
    with torch.no_grad():
        for p in smol.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    llama.load_state_dict(smol.state_dict())
    ids = token_ids(2, 24)
    expected = no_grad_logits(smol, ids)
    assert not torch.allclose(no_grad_logits(llama, ids), expected, atol=1e-3)  # guard: NoPE matters
    hf_posenc.patch_model(llama, request_form)
    torch.testing.assert_close(no_grad_logits(llama, ids), expected, atol=ATOL, rtol=0)


# -- every layer runs its own encoding ----------------------------------------------------------------


def _plain_twin(model, name: str, params: dict, owned: list[int], part: torch.nn.Module):
    """A copy of ``model``'s weights patched plainly with ``name``, holding ``part``'s tensors in
    the layers ``part`` owns (a per-layer tensor list of the plain patch is indexed by model layer)."""
    twin = four_layer_model()
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("posenc.")})
    hf_posenc.patch_model(twin, name, **params)
    plain_state = twin.posenc.state_dict()
    with torch.no_grad():
        for key, value in part.state_dict().items():
            match = re.match(r"^(.*?)\.(\d+)\.(.*)$", key)
            target = key
            if match and len(twin.posenc.get_submodule(match[1])) == LAYERS:
                target = f"{match[1]}.{owned[int(match[2])]}.{match[3]}"
            plain_state[target].copy_(value)
    return twin


def _layer_io(model, ids):
    """(input, output) hidden states of every decoder layer."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(
            layer.register_forward_hook(
                lambda m, a, kw, out, i=i: seen.__setitem__(
                    i,
                    [kw.get("hidden_states", a[0] if a else None), out[0] if isinstance(out, tuple) else out],
                ),
                with_kwargs=True,
            )
        )
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


def _layer_output_given(model, layer: int, ids, hidden: torch.Tensor) -> torch.Tensor:
    """Output of ``model``'s decoder layer ``layer`` when its input is replaced by ``hidden``."""
    captured = {}

    def replace(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = hidden
            return args, kwargs
        return (hidden, *args[1:]), kwargs

    block = model.model.layers[layer]
    handles = [
        block.register_forward_pre_hook(replace, with_kwargs=True),
        block.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out)),
    ]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    out = captured["out"]
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", list(MIXED))
def test_each_layer_equals_that_layer_of_the_plain_patch(name):
    """Layer i of a hybrid gives what layer i of the model patched plainly with layer i's encoding
    (same tensors) gives for the same input; the mix matters (the layers' encodings differ)."""
    model = hybrid(name)
    _, per_layer, params = MIXED[name]
    info = hf_posenc.patch_info(model)
    names = [info["params"]["parts"][i]["encoding"] for i in info["params"]["layers"]]
    assert names == per_layer
    ids = token_ids(2, 12)
    seen = _layer_io(model, ids)
    for index, part in enumerate(model.posenc.parts):
        owned = model.posenc.owned(index)
        twin = _plain_twin(model, part.name, params.get(part.name, {}), owned, part)
        for layer in owned:
            expected = _layer_output_given(twin, layer, ids, seen[layer][0])
            torch.testing.assert_close(seen[layer][1], expected, atol=ATOL, rtol=0)


def test_a_part_holds_tensors_for_its_own_layers_only():
    """t5 with one table per layer in layers 0 and 2 of 4 has two tables, saved as posenc.parts.0.*."""
    model = hybrid("t5/fox")
    keys = [k for k in model.state_dict() if k.startswith("posenc.") and "reload_with" not in k]
    assert keys == [
        "posenc.parts.0.tables.0.weight",
        "posenc.parts.0.tables.1.weight",
        "posenc.parts.1.forget.0.weight",
        "posenc.parts.1.forget.0.bias",
        "posenc.parts.1.forget.1.weight",
        "posenc.parts.1.forget.1.bias",
    ]
    assert model.posenc.parts[0].geometry.num_layers == 2


@pytest.mark.parametrize(
    ("request_form", "plain"),
    [
        (["alibi"], "alibi"),
        ("t5*2", "t5"),
        ([("rope", {"theta": 500.0}), "rope"], None),
        ({"default": "sinusoidal"}, "sinusoidal"),
        (("rope", {"theta": 500.0}), None),
    ],
)
def test_a_pattern_of_one_encoding_is_the_plain_patch(request_form, plain):
    """Every layer with the same encoding and parameters: the plain patch (same config.posenc,
    state_dict keys and logits); a keyword goes to every entry that has it."""
    ids = token_ids(2, 12)
    kwargs = {"theta": 500.0} if plain is None else {}
    reference = four_layer_model()
    hf_posenc.patch_model(reference, plain or "rope", **({"theta": 500.0} if plain is None else {}))
    model = four_layer_model()
    hf_posenc.patch_model(model, request_form, **kwargs)
    assert model.config.posenc == reference.config.posenc
    assert list(model.state_dict()) == list(reference.state_dict())
    torch.testing.assert_close(no_grad_logits(model, ids), no_grad_logits(reference, ids), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("request_form", "message"),
    [
        (["rope", "sinusoidal"], "'sinusoidal' is not allowed in a per-layer pattern: it adds positions"),
        (["learned", "nope"], "'learned' is not allowed in a per-layer pattern"),
        (["rope", "tape"], "'tape' is not allowed in a per-layer pattern: it passes a positional stream"),
        ("rope*0+nope", "entry 'rope\\*0' is not allowed"),
        ("rope++nope", "entry '' is not allowed"),
        ({0: "rope", 1: "nope"}, "leave layer\\(s\\) \\[2, 3\\] without an encoding"),
        ({"default": "rope", 7: "nope"}, "name layer\\(s\\) \\[7\\]"),
        ([], "at least one entry"),
        (["rope", 3], "hybrid entry 3 is not allowed"),
        (["rope", ("nope", {"theta": 1.0})], "has no parameter 'theta'"),
        (
            {"encoding": "hybrid", "params": {"parts": [{"encoding": "rope"}], "layers": [0, 0, 0]}},
            "'layers' must give one part index \\(0 .. 0\\) per layer of the model \\(4\\)",
        ),
        (
            {
                "encoding": "hybrid",
                "params": {"parts": [{"encoding": "rope"}], "layers": [0] * 4},
                "format_version": 3,
            },
            "format_version=3 is not supported",
        ),
    ],
)
def test_bad_patterns_are_refused_before_anything_changes(request_form, message):
    model = four_layer_model()
    keys = list(model.state_dict())
    with pytest.raises(InvalidParameterError, match=message):
        hf_posenc.patch_model(model, request_form)
    assert hf_posenc.patch_info(model) is None and list(model.state_dict()) == keys


def test_a_keyword_no_entry_has_is_refused():
    with pytest.raises(
        InvalidParameterError, match="no encoding of the pattern has parameter\\(s\\) 'banana'"
    ):
        hf_posenc.patch_model(four_layer_model(), ["rope", "nope"], banana=1)


# -- reconfigure, patch_info ------------------------------------------------------------------


def test_reconfigure_changes_every_part_that_has_the_parameter():
    """A scaling goes to the parts that take one: their layers then equal the plainly patched,
    scaled encoding; the learned tensors stay; a parameter no part has is refused."""
    model = hybrid("t5/fox")
    tensors = {k: v.clone() for k, v in model.posenc.state_dict().items()}
    scaling = {"type": "linear", "factor": 2.0}
    hf_posenc.reconfigure(model, scaling=scaling)
    parts = hf_posenc.patch_info(model)["params"]["parts"]
    assert parts[0]["params"]["scaling"] == scaling and model.config.posenc["params"]["parts"] == parts
    assert all(torch.equal(model.posenc.state_dict()[k], v) for k, v in tensors.items())
    twin = _plain_twin(
        model, "t5", {**MIXED["t5/fox"][2]["t5"], "scaling": scaling}, [0, 2], model.posenc.parts[0]
    )
    ids = token_ids(2, 12)
    seen = _layer_io(model, ids)
    torch.testing.assert_close(seen[2][1], _layer_output_given(twin, 2, ids, seen[2][0]), atol=ATOL, rtol=0)
    with pytest.raises(InvalidParameterError, match="no encoding of the hybrid t5\\+fox has parameter"):
        hf_posenc.reconfigure(model, banana=1)
    with pytest.raises(InvalidParameterError, match="change the learned tensors"):
        hf_posenc.reconfigure(model, num_buckets=4)
    assert hf_posenc.patch_info(model)["params"]["parts"] == parts


def test_patch_info_and_errors_explain_the_hybrid():
    model = four_layer_model()
    hf_posenc.patch_model(model, "rope*3+nope")
    info = hf_posenc.patch_info(model)
    assert info["encoding"] == "hybrid" and info["pattern"] == "rope*3+nope"
    assert info["params"]["layers"] == [0, 0, 0, 1]
    assert [p["encoding"] for p in info["params"]["parts"]] == ["rope", "nope"]
    with pytest.raises(AlreadyPatchedError, match="hybrid rope\\*3\\+nope"):
        hf_posenc.patch_model(model, "alibi")
