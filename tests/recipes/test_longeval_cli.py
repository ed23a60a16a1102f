"""``hf-posenc longeval``: bad input is one line before any model loads; a run on tiny checkpoints writes
results.json (per model, task, length and depth: accuracy, samples, exact prompt tokens; provenance),
results.md and the pictures, and every prompt the model read had exactly the requested length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from longeval_reference import bpe_tokenizer, char_level_tokenizer

import hf_posenc
from hf_posenc.core.registry import families
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.tiny import tiny_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("longeval")
    tokenizer = bpe_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    learned = tiny_model("llama", vocab_size=len(tokenizer), max_positions=64)
    hf_posenc.patch_model(learned, "learned", max_positions=256)
    learned.save_pretrained(root / "learned")
    tokenizer.save_pretrained(root / "learned")
    digitless = char_level_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,?:\n")
    tiny_model("llama", vocab_size=len(digitless), max_positions=64).save_pretrained(root / "no-digits")
    digitless.save_pretrained(root / "no-digits")
    return root


def _run(root: Path, *extra: str, model: str = "llama", out: str = "out") -> list[str]:
    return [
        "longeval",
        "--model",
        str(root / model),
        "--output-dir",
        str(root / out),
        "--no-progress",
        *extra,
    ]


BAD = {
    "unknown task": (["--tasks", "paskey"], "unknown task 'paskey'. Did you mean 'passkey'?"),
    "depth outside [0, 1]": (
        ["--depths", "0.5", "-0.1"],
        "depth -0.1 is not allowed; allowed: fractions in [0, 1]",
    ),
    "zero samples": (["--samples", "0"], "--samples 0 is not allowed"),
    "under the task's minimum": (
        ["--tasks", "vt", "--lengths", "20"],
        "--lengths 20 is under vt's minimum of",
    ),
    "over the learned table": (
        ["--tasks", "passkey", "--lengths", "300"],
        "evaluation length 310 is longer than the learned position table (max_positions=256) covers (256 positions at this scaling); "
        "lower --lengths",
    ),
    "no digits in the vocabulary": (["--tasks", "passkey"], "the tokenizer cannot express passkey's answers"),
    "typo in the encoding": (["--encoding", "alibbi"], "Did you mean 'alibi'"),
    # vt and fwe place nothing at a depth: the depths were dropped without a word
    "depths for tasks without one": (
        ["--tasks", "vt", "fwe", "--depths", "0.5"],
        "--depths with only tasks that have no depth would be ignored; allowed: add a task placed at a depth",
    ),
}
MODEL_OF = {"over the learned table": "learned", "no digits in the vocabulary": "no-digits"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_before_any_model_loads(checkpoints, case, capsys, monkeypatch):
    import hf_posenc.core.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load_model", refuse)
    extra, message = BAD[case]
    assert main(_run(checkpoints, *extra, model=MODEL_OF.get(case, "llama"), out=f"bad-{len(extra)}")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("hf-posenc longeval: error:"), errors
    assert message in errors[0], errors


def test_another_runs_results_are_not_overwritten(checkpoints, capsys):
    folder = checkpoints / "taken"
    folder.mkdir()
    (folder / "results.json").write_text("{}")
    assert main(_run(checkpoints, out="taken")) == 2
    assert "holds another run's results (results.json)" in capsys.readouterr().err
    assert (folder / "results.json").read_text() == "{}"


def _check_outputs(
    folder: Path, labels: list[str], tasks: list[str], lengths: list[int], depths: list[float]
):
    document = json.loads((folder / "results.json").read_text())
    assert set(document["results"]) == set(labels)
    assert document["metadata"]["provenance"]["command"].startswith("hf-posenc longeval")
    assert {"versions", "git_commit", "date"} <= set(document["metadata"]["provenance"])
    for cells in document["results"].values():
        keyed = {(c["task"], c["length"], c["depth"]): c for c in cells}
        for task in tasks:
            for length in lengths:
                overall = keyed[(task, length, None)]
                assert overall["prompt_tokens"] == length and 0.0 <= overall["accuracy"] <= 1.0
                if document["tasks"][task]["uses_depth"]:
                    assert all(
                        keyed[(task, length, d)]["samples"] == document["settings"]["samples"] for d in depths
                    )
                    assert overall["samples"] == len(depths) * document["settings"]["samples"]
    assert (folder / "results.md").is_file() and (folder / "accuracy_vs_length.png").stat().st_size > 0
    assert len(list(folder.glob("heatmap_*.png"))) == len(labels)


@pytest.mark.slow
def test_a_run_writes_results_and_pictures(checkpoints, capsys):
    lengths, depths = [200, 240], [0.0, 1.0]
    argv = [
        "--tasks",
        "passkey",
        "niah_single",
        "--lengths",
        *map(str, lengths),
        "--depths",
        *map(str, depths),
    ]
    argv += ["--samples", "2", "--batch-size", "2", "--train-length", "210", "--labels", "tiny"]
    assert main(_run(checkpoints, *argv, out="run")) == 0
    printed = capsys.readouterr().out
    assert "tiny" in printed and "niah_single" in printed
    _check_outputs(checkpoints / "run", ["tiny"], ["passkey", "niah_single"], lengths, depths)
    assert main(_run(checkpoints, *argv, "--overwrite", out="run")) == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", list(families()))
def test_every_family_runs_through_the_command_line(tmp_path, family, capsys):
    """A tiny checkpoint of each family, natively and patched with alibi, on passkey and vt."""
    tokenizer = bpe_tokenizer()
    model = tiny_model(family, vocab_size=len(tokenizer), max_positions=512)
    model.save_pretrained(tmp_path / "native")
    tokenizer.save_pretrained(tmp_path / "native")
    hf_posenc.patch_model(model, "alibi")
    model.save_pretrained(tmp_path / "alibi")
    tokenizer.save_pretrained(tmp_path / "alibi")
    argv = ["longeval", "--model", str(tmp_path / "native"), str(tmp_path / "alibi"), "--no-progress"]
    argv += ["--tasks", "passkey", "vt", "--lengths", "300", "--depths", "0.5", "--samples", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    labels = list(json.loads((tmp_path / "out" / "results.json").read_text())["results"])
    assert len(labels) == 2
    _check_outputs(tmp_path / "out", labels, ["passkey", "vt"], [300], [0.5])
