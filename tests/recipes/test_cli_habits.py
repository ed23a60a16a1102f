"""Command-line habits of the ecosystem (issue 24): malformed JSON named by its column, a closed
pipe is not an error, family names as users write them, API errors are PosencError subclasses,
lm-eval's git probe stays off the console, the study passes --report-to to every run."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hf_posenc
from hf_posenc.errors import CheckpointError, PosencError
from hf_posenc.recipes.cli import build_parser, main
from hf_posenc.recipes.tiny import tiny_model


@pytest.mark.parametrize(
    ("value", "column"),
    [('scaling={"type":linear}', 9), ('scaling={"type": "linear", "factor": 2', 31), ("p=[1, 2,", 7)],
)
def test_malformed_json_in_an_encoding_param_is_named_with_its_column(value, column, capsys, tmp_path):
    """The column counts from 1 within the value: where the parser stopped (a character, or the end)."""
    argv = ["train", "--model", "m", "--output-dir", str(tmp_path / "o"), "--encoding", "rope"]
    assert main([*argv, "--encoding-param", value, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"malformed JSON at column {column}" in err, err
    assert not (tmp_path / "o").exists()


def test_a_plain_string_value_is_still_a_string():
    from hf_posenc.recipes.cli.common import parse_encoding_params

    assert parse_encoding_params(["variant=power", "factor=2"]) == {"variant": "power", "factor": 2}


@pytest.mark.slow  # a subprocess (seconds)
def test_list_piped_into_head_ends_quietly():
    out = subprocess.run(
        f"{sys.executable} -m hf_posenc list | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.count("\n") == 1 and out.stderr == "", out.stderr


def test_family_names_are_taken_as_users_write_them():
    from hf_posenc.core.registry import get_family

    assert get_family("gemma3_text") is get_family("gemma3")
    parser = build_parser()
    assert parser.parse_args(["check", "--families", "gemma3_text", "llama"]).families == ["gemma3", "llama"]
    assert parser.parse_args(["bench", "--family", "gemma3_text"]).family == "gemma3"


def test_loading_a_checkpoint_as_another_encoding_raises_a_posenc_error(tmp_path):
    model = tiny_model("llama", vocab_size=64, max_positions=32)
    hf_posenc.patch_model(model, "alibi")
    model.save_pretrained(tmp_path / "alibi")
    tiny_model("llama", vocab_size=64, max_positions=32).save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="saved with encoding 'alibi'"):
        hf_posenc.load_model(str(tmp_path / "alibi"), encoding="t5")
    with pytest.raises(PosencError, match="has no 'posenc' entry|not saved from a model patched"):
        hf_posenc.from_pretrained(str(tmp_path / "plain"))
    with pytest.raises(PosencError, match="without an encoding name"):
        hf_posenc.load_model(str(tmp_path / "plain"), encoding_params={"theta": 5.0})


def test_lm_evals_git_probe_prints_nothing_outside_a_checkout(tmp_path, monkeypatch, capfd):
    from lm_eval import evaluator

    from hf_posenc.recipes.integrations.lm_eval_model import quiet_git_probe

    monkeypatch.setattr(evaluator, "get_git_commit_hash", evaluator.get_git_commit_hash)  # restored after
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    quiet_git_probe()
    assert evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""


def test_study_report_to_reaches_every_run(tmp_path):
    from hf_posenc.recipes.study import StudyConfig
    from hf_posenc.recipes.study.runs import _base_settings, _run_settings

    config = StudyConfig(output_dir=str(tmp_path), encodings=["alibi"], report_to=["tensorboard"])
    assert _base_settings(config, tmp_path).report_to == ["tensorboard"]
    assert _run_settings(config, tmp_path / "base", "alibi", tmp_path).report_to == ["tensorboard"]
    args = build_parser().parse_args(["study", "--report-to", "tensorboard", "wandb"])
    assert args.report_to == ["tensorboard", "wandb"]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--model", "./nope", "--output-dir", "out"],
        ["perplexity", "--model", "./nope", "--data", "x.txt", "--train-length", "8", "--output", "out"],
        ["study", "--base-model", "./nope"],
        ["lm-eval", "--pretrained", "./nope", "--tasks", "arc_easy"],
    ],
)
def test_a_missing_model_is_answered_before_torch_is_imported(argv, tmp_path):
    """The path check comes first: no torch, transformers or lm-eval import before the answer."""
    code = (
        "import sys; from hf_posenc.recipes.cli import main; rc = main(sys.argv[1:]); "
        "print(rc, sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))"
    )
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(hf_posenc.__file__).parents[1])}  # this checkout
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.stdout.split() == ["2", "[]"], (out.stdout, out.stderr)
    assert "./nope" in out.stderr and out.stderr.count("\n") == 1


def test_rows_are_named_after_the_run(tmp_path, monkeypatch):
    from hf_posenc.recipes.evaluation.labels import run_name

    assert run_name("runs/alibi/final") == "alibi"
    assert run_name("runs/alibi/final/") == "alibi"
    assert run_name("runs/alibi/checkpoint-200") == "alibi/checkpoint-200"
    assert run_name("HuggingFaceTB/SmolLM2-135M") == "SmolLM2-135M"
    (tmp_path / "my-run" / "final").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my-run")
    assert run_name("final") == "my-run" and run_name("./final") == "my-run"


@pytest.mark.parametrize(
    ("argv", "typo", "meant"),
    [
        (["perplexity", "--modle", "m"], "--modle", "--model"),  # a command with required options
        (["train", "--modle", "m"], "--modle", "--model"),
        (["bench", "--lenghts", "64"], "--lenghts", "--lengths"),  # one without
        (["study", "--encodng", "rope"], "--encodng", "--encodings"),
    ],
)
def test_a_mistyped_option_is_named_with_the_option_meant(argv, typo, meant, capsys):
    """One line naming the unknown option and the known option closest to it, before anything
    runs, instead of the required options still missing or a bare "unrecognized arguments"."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"hf-posenc {argv[0]}: error: unrecognized arguments: {typo} (did you mean {meant}?)", last


def test_an_unknown_option_far_from_every_known_one_is_named_alone(capsys):
    with pytest.raises(SystemExit):
        main(["export", "--zzzz"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hf-posenc export: error: unrecognized arguments: --zzzz"
    )


def test_abbreviations_and_values_are_read_as_before():
    """argparse's unique prefixes still name their option (``--len`` is ``--lengths``), and a value
    that starts with a dash is a value (``--lengths -5`` reaches the command's own check)."""
    args = build_parser().parse_args(["bench", "--len", "64", "128", "--encodings", "rope"])
    assert args.lengths == [64, 128]
    args = build_parser().parse_args(["bench", "--lengths", "-5"])
    assert args.lengths == [-5]


def test_a_required_choice_of_options_is_kept_while_a_typo_is_named(capsys):
    """The unknown-option check parses with nothing required and puts every required flag back
    (a required mutually exclusive group included): a later parse still requires them."""
    from hf_posenc.recipes.cli.common import CommandParser

    parser = CommandParser(prog="hf-posenc x")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--alpha")
    group.add_argument("--beta")
    with pytest.raises(SystemExit):
        parser.parse_args(["--alpah", "1"])
    assert "unrecognized arguments: --alpah (did you mean --alpha?)" in capsys.readouterr().err
    assert parser.parse_args(["--beta", "2"]).beta == "2"
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "one of the arguments --alpha --beta is required" in capsys.readouterr().err
