"""``export_native`` / ``hf-posenc export``: a patched model written as a plain transformers
checkpoint loads with plain ``AutoModelForCausalLM`` (no posenc entry, no posenc tensors) and gives
the patched model's logits; everything without a native twin is refused in one line with nothing
written. Reference: the patched model itself, on inputs other than the export's own probe."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model, patch, token_ids
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc.core.export import ExportError
from hf_posenc.recipes.cli import main

EXPORTABLE = [
    ("llama", "rope", {}),
    ("llama", "rope", {"scaling": {"type": "linear", "factor": 2.0}}),
    ("llama", "rope", {"scaling": {"type": "ntk", "factor": 2.0}}),
    ("llama", "rope", {"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ("llama", "rope", {"scaling": {"type": "llama3", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ("mistral", "rope", {"theta": 500.0}),
    ("qwen2", "rope", {}),
    ("qwen3", "rope", {"theta": 500.0}),
    ("olmo2", "rope", {}),
    ("phi3", "rope", {}),
    ("gemma3", "rope", {}),
    ("smollm3", "rope", {}),
    ("smollm3", "nope", {}),
    ("smollm3", "rope+nope", {}),
    ("smollm3", "nope+rope", {}),
    ("gpt2", "learned", {}),
]


@pytest.mark.parametrize(
    ("family", "name", "params"), EXPORTABLE, ids=[f"{f}-{n}-{p}" for f, n, p in EXPORTABLE]
)
def test_export_loads_in_plain_transformers_with_equal_logits(family, name, params, tmp_path):
    model = patch(make_model(family), name, params)  # learned: a randomised table (not GPT-2's own)
    hf_posenc.export_native(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "posenc" not in config
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert not [key for key in f.keys() if key.startswith("posenc")]  # noqa: SIM118
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids(2, 40, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    # explicit padding-aware positions: a plain forward of native GPT-2 numbers padding too
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
        got = plain(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 5:], expected[1, 5:], atol=1e-5, rtol=0)
    assert hf_posenc.patch_info(model)["encoding"] in (name, "hybrid")  # the model itself is unchanged


REFUSED = [
    ("llama", "alibi", {}, "its native configuration has RoPE on every layer, not alibi"),
    ("llama", "xpos", {}, "not xpos"),
    ("llama", "selfextend", {}, "not selfextend"),
    ("llama", "rope+nope", {}, "not rope on layer 0, nope on layer 1"),
    ("llama", "rope", {"scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic scaling is causal"),
    ("gpt2", "rope", {}, "learned table (wpe), not rope"),
    ("gpt2", "learned", {"scaling": {"type": "linear", "factor": 2.0}}, "linear interpolation"),
    ("gemma3", "rope", {"theta": 500.0}, "per layer type"),
    ("smollm3", "alibi", {}, "RoPE or NoPE per layer, not alibi"),
]


@pytest.mark.parametrize(
    ("family", "name", "params", "why"), REFUSED, ids=[f"{f}-{n}-{p}" for f, n, p, _ in REFUSED]
)
def test_no_native_twin_is_refused_in_one_line_and_nothing_is_written(family, name, params, why, tmp_path):
    model = patch(make_model(family), name, params)
    with pytest.raises(ExportError, match="no native transformers equivalent") as error:
        hf_posenc.export_native(model, tmp_path / "out")
    message = str(error.value)
    assert why in message and "possible:" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # no target, no staging folder left behind


def test_a_non_empty_target_or_an_unpatched_model_is_refused(tmp_path):
    model = patch(make_model("llama"), "rope", {})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not an empty folder"):
        hf_posenc.export_native(model, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="not an empty folder"):
        hf_posenc.export_native(model, tmp_path / "file")
    with pytest.raises(ExportError, match="not patched"):
        hf_posenc.export_native(make_model("llama"), tmp_path / "new")
    (tmp_path / "empty").mkdir()
    hf_posenc.export_native(model, tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "config.json").is_file()


def test_cli_exports_a_saved_checkpoint_and_refuses_in_one_line(tmp_path, capsys):
    patch(make_model("llama"), "rope", {"scaling": {"type": "linear", "factor": 2.0}}).save_pretrained(
        tmp_path / "rope"
    )
    assert main(["export", str(tmp_path / "rope"), str(tmp_path / "out")]) == 0
    assert "posenc" not in json.loads((tmp_path / "out" / "config.json").read_text())
    patch(make_model("llama"), "alibi", {}).save_pretrained(tmp_path / "alibi")
    make_model("llama").save_pretrained(tmp_path / "plain")
    for argv, message in [
        ([str(tmp_path / "alibi"), str(tmp_path / "a")], "no native transformers equivalent"),
        ([str(tmp_path / "plain"), str(tmp_path / "b")], "already is a plain transformers checkpoint"),
        ([str(tmp_path / "rope"), str(tmp_path / "out")], "not an empty folder"),
    ]:
        capsys.readouterr()
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
