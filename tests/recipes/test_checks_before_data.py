"""A request the model's config already refuses ends in one line before any data is read or any
model loads: a per-layer pattern longer than the checkpoint's depth, a linear scaling whose
positions leave float32 (on a fresh patch, and as an override of a saved checkpoint's
scaling), for ``train`` (``--dry-run`` included), ``study`` and ``perplexity``.

Before, ``train`` tokenised its data (and wrote the token cache) and ``perplexity`` read its
evaluation text before the patch refused these: with a real corpus, minutes of work for a
one-line mistake. Property: the refusal is one line naming the value and its bound, and no
data cache or report exists afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_runs import base_workspace, error_lines, one_error, perplexity_argv, train_argv
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_posenc
from hf_posenc.recipes.cli import main

TINY = '{"type": "linear", "factor": 1e-40}'  # rope / alibi: past float32 at any horizon
LIERE = '{"type": "linear", "factor": 1e-9}'  # liere: past where its matrix exponential is finite


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = base_workspace(tmp_path_factory.mktemp("before-data"))
    model = hf_posenc.patch_model(AutoModelForCausalLM.from_pretrained(root / "base"), "alibi+t5")
    model.save_pretrained(root / "alibi-t5")
    AutoTokenizer.from_pretrained(root / "base").save_pretrained(root / "alibi-t5")
    return root


def train(workspace: Path, tmp_path: Path, model: str, *extra: str) -> int:
    return main(train_argv(workspace, model, tmp_path / "run", *extra))


@pytest.mark.parametrize("dry_run", [False, True])
def test_train_refuses_a_pattern_longer_than_the_depth_before_reading_data(
    workspace, tmp_path, capsys, dry_run
):
    depth = json.loads((workspace / "base" / "config.json").read_text())["num_hidden_layers"]
    pattern = f"rope*{depth}+nope"
    extra = ["--dry-run"] if dry_run else []
    assert train(workspace, tmp_path, "base", "--encoding", pattern, *extra) == 2
    line = one_error(capsys)
    assert repr(pattern) in line and f"{depth + 1} entries" in line and f"{depth} layer(s)" in line, line
    assert not (tmp_path / "run" / "data-cache").exists()  # nothing was tokenised


@pytest.mark.parametrize("encoding", ["rope", "alibi", "liere"])
def test_train_refuses_a_scaling_past_float32_before_reading_data(workspace, tmp_path, capsys, encoding):
    factor = LIERE if encoding == "liere" else TINY
    assert (
        train(workspace, tmp_path, "base", "--encoding", encoding, "--encoding-param", f"scaling={factor}")
        == 2
    )
    line = one_error(capsys)
    assert f"{encoding}: parameter scaling=" in line and "allowed: factor >= " in line, line
    assert not (tmp_path / "run" / "data-cache").exists()


def test_continuing_a_saved_hybrid_with_such_an_override_is_refused_before_reading_data(
    workspace, tmp_path, capsys
):
    assert train(workspace, tmp_path, "alibi-t5", "--encoding-param", f"scaling={TINY}") == 2
    line = one_error(capsys)
    assert "alibi: parameter scaling=" in line and "allowed: factor >= " in line, line
    assert not (tmp_path / "run" / "data-cache").exists()


def test_study_refuses_a_pattern_longer_than_the_base_models_depth(workspace, tmp_path, capsys):
    argv = ["study", "--base-model", str(workspace / "base"), "--output-dir", str(tmp_path / "study")]
    assert main([*argv, "--encodings", "alibi*3+nope", "--dry-run"]) == 2
    line = one_error(capsys)
    assert "'alibi*3+nope'" in line and "4 entries" in line, line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--encodings", "alibi*5+nope"], "'alibi*5+nope' has 6 entries but the model has 4 layer(s)"),
        (["--encodings", f'rope{{"scaling": {TINY}}}'], "past the float32 range"),
        (["--hidden-size", "30"], "(hidden_size=30, 4 heads): not a model llama can build"),
        (["--hidden-size", "20"], "RoPE requires an even rotary dimension"),
        (["--vocab-size", "5"], "vocab_size=5 is not allowed; allowed: an integer >= 300"),
        (["--max-documents", "0"], "max_documents=0 is not allowed; allowed: an integer >= 1"),
    ],
)
def test_study_checks_its_embedded_base_model_before_training_it(tmp_path, capsys, extra, message):
    """Without --base-model the study pretrains a tiny Llama of --hidden-size / --num-layers on a
    tokenizer of --vocab-size first: a shape that model cannot have, or an encoding that cannot
    patch it, was found only after the tokenizer and the base were trained (or, for the
    vocabulary, after the documents were read, as a traceback). Now one line, before anything."""
    out = tmp_path / "study"
    assert main(["study", "--output-dir", str(out), "--steps", "1", "--pretrain-steps", "1", *extra]) == 2
    line = one_error(capsys)
    assert message in line, line
    assert not out.exists() or not any(out.iterdir())  # no tokenizer, no base model, no run


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--base-model", "{base}", "--hidden-size", "64", "--pretrain-steps", "5"],
            "--hidden-size, --pretrain-steps with --base-model (they shape and pretrain the embedded base) would be "
            "ignored; allowed: drop --base-model",
        ),
        (
            ["--retrieval-documents", "0", "--retrieval-samples", "2", "--retrieval-max-key", "50"],
            "--retrieval-samples, --retrieval-max-key with --retrieval-documents 0 would be ignored",
        ),
    ],
)
def test_study_flags_its_settings_would_ignore_are_refused(workspace, tmp_path, capsys, extra, message):
    """The embedded base's flags with a given base model, and the passkey prompts' flags with no
    passkey documents, did nothing and said nothing."""
    extra = [str(workspace / "base") if value == "{base}" else value for value in extra]
    out = tmp_path / "study"
    assert main(["study", "--output-dir", str(out), "--encodings", "alibi", "--dry-run", *extra]) == 2
    line = one_error(capsys)
    assert message in line, line


@pytest.mark.parametrize(
    "model, extra, factor",
    [
        ("base", ["--encoding", "rope"], TINY),
        ("base", ["--encoding", "liere"], LIERE),
        ("alibi-t5", [], TINY),
    ],
    ids=[
        "fresh patch",
        "fresh patch, bound read from the initial generators",
        "override of a saved checkpoint",
    ],
)
def test_perplexity_refuses_a_scaling_past_float32_before_reading_its_text(
    workspace, tmp_path, capsys, model, extra, factor
):
    argv = perplexity_argv(
        workspace, model, tmp_path / "report", *extra, "--encoding-param", f"scaling={factor}"
    )
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = error_lines(captured.err)
    assert len(errors) == 1 and "parameter scaling=" in errors[0] and "allowed: factor >= " in errors[0], (
        captured
    )
    assert "tokens" not in captured.out + captured.err  # the evaluation text was not read
    assert not (tmp_path / "report" / "results.json").exists()


def test_longeval_refuses_a_scaling_past_float32_before_loading_the_model(workspace, tmp_path, capsys):
    argv = ["longeval", "--model", str(workspace / "base"), "--encoding", "liere"]
    argv += ["--encoding-param", f"scaling={LIERE}", "--tasks", "passkey", "--lengths", "512"]
    assert main([*argv, "--output", str(tmp_path / "retrieval")]) == 2
    line = one_error(capsys)  # no model loaded
    assert "liere: parameter scaling=" in line and "allowed: factor >= " in line, line


@pytest.mark.parametrize("command", ["train", "study", "perplexity", "longeval"])
def test_a_hand_edited_config_posenc_is_one_line_in_every_command(workspace, tmp_path, capsys, command):
    """``config.posenc`` edited into a string: train (without --encoding-param) and study
    raised AttributeError ('str' object has no attribute 'get'); every command names the value."""
    import shutil

    edited = workspace / f"edited-{command}"
    shutil.copytree(workspace / "alibi-t5", edited)
    config = json.loads((edited / "config.json").read_text())
    config["posenc"] = "alibi"
    (edited / "config.json").write_text(json.dumps(config))
    argv = {
        "train": train_argv(workspace, edited.name, tmp_path / "run"),
        "study": ["study", "--base-model", str(edited), "--output-dir", str(tmp_path / "s"), "--dry-run"],
        "perplexity": perplexity_argv(workspace, edited.name, tmp_path / "p"),
        "longeval": ["longeval", "--model", str(edited), "--lengths", "512", "--output", str(tmp_path / "l")],
    }[command]
    assert main(argv) == 2
    line = one_error(capsys)
    assert "config.posenc='alibi' is not allowed; allowed: the mapping hf_posenc writes" in line, line
