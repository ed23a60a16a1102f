"""How the command line presents and takes settings: every subcommand's --help shows each option's
default; `train --config FILE` (YAML or JSON) takes settings from a file with the flags given on
the command line winning; `train --dry-run` prints the resolved settings and loads nothing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_posenc.recipes.cli import build_parser, main
from hf_posenc.recipes.cli.lm_eval import _recipe_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    choices = dict(parser._subparsers._group_actions[0].choices)
    choices["lm-eval"] = _recipe_parser(lm_eval_options=True)  # its own parser prints its help
    return choices


def _shown(default: object) -> str | None:
    """The default as --help should show it, or None where nothing is to show (a switch that is off,
    no default, an empty list)."""
    if default is None or default is False or default == [] or default is argparse.SUPPRESS:
        return None
    return " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_option_has_help_that_shows_its_default(name):
    subparser = _subparsers()[name]
    text = "".join(subparser.format_help().split())  # line wrapping may split anywhere
    for action in subparser._actions:
        if not action.option_strings:
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help text"
        shown = _shown(action.default)
        if shown is not None:
            assert f"(default:{''.join(shown.split())})" in text, f"{name} {action.option_strings[0]}"


def _file(tmp_path: Path, suffix: str, values: dict) -> Path:
    path = tmp_path / f"run{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(values))
    else:
        import yaml

        path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture
def model_dir(tmp_path_factory) -> Path:
    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tiny import tiny_model
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("settings")
    tokenizer = train_bpe_tokenizer(list(stdlib_documents())[:4], vocab_size=300)
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    return root


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_train_config_file_is_read_and_flags_given_win(model_dir, tmp_path, suffix, capsys):
    """Settings come from the file; a flag on the command line wins even when it repeats the default
    (3e-4 is --lr's default, the file says 1e-3: the flag was given, so 3e-4); encoding parameters
    merge key by key, the flag's value winning."""
    settings = {
        "train": {
            "model": str(model_dir / "model"),
            "output_dir": str(tmp_path / "out"),
            "data": [str(model_dir / "data.txt")],
            "encoding": "t5",
            "encoding_params": {"num_buckets": 16, "max_distance": 64},
            "max_steps": 7,
            "lr": 1e-3,
            "seq_len": 32,
        }
    }
    config = _file(tmp_path, suffix, settings)
    argv = ["train", "--config", str(config), "--lr", "3e-4", "--encoding-param", "num_buckets=8"]
    assert main([*argv, "--max-steps", "5", "--dry-run"]) == 0
    out = capsys.readouterr()
    resolved = json.loads(out.out)
    assert resolved["max_steps"] == 5 and resolved["lr"] == 3e-4
    assert resolved["seq_len"] == 32 and resolved["encoding"] == "t5"
    assert resolved["encoding_params"] == {"num_buckets": 8, "max_distance": 64}
    assert "dry run" in out.err
    assert not (tmp_path / "out").exists()  # nothing written


def _train_dry_run_of_yaml(model_dir: Path, tmp_path: Path, capsys, settings: str) -> dict:
    """The resolved settings `train --dry-run` prints for a YAML file of the test model, an output
    folder and ``settings`` (YAML lines)."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model_dir / 'model'}\noutput_dir: {tmp_path / 'out'}\n{settings}")
    assert main(["train", "--config", str(config), "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_list_setting_given_one_value_in_a_file_is_a_list_of_it(model_dir, tmp_path, capsys):
    """`data: corpus.txt` in a YAML file (one source, no brackets) is the list of that source; it was
    iterated as a string, each character a data source ("data source 't' is not a file ..."), and
    a study's `encodings: alibi` each character an encoding."""
    resolved = _train_dry_run_of_yaml(
        model_dir, tmp_path, capsys, f"data: {model_dir / 'data.txt'}\nreport_to: tensorboard\n"
    )
    assert resolved["data"] == [str(model_dir / "data.txt")] and resolved["report_to"] == ["tensorboard"]
    study = tmp_path / "study.yaml"
    study.write_text(
        f"data: {model_dir / 'data.txt'}\neval_data: {model_dir / 'data.txt'}\nencodings: alibi\nmultiples: 2\n"
    )
    assert main(["study", "--config", str(study), "--output-dir", str(tmp_path / "s"), "--dry-run"]) == 0
    plan = capsys.readouterr()
    assert "alibi" in plan.out + plan.err


def test_yaml_scientific_notation_is_a_number(model_dir, tmp_path, capsys):
    """`lr: 1e-3` in YAML: PyYAML's YAML 1.1 reads floats only with a dot (`1.0e-3`), so this was the
    string '1e-3', refused as "not a number"; JSON and YAML 1.2 read a float, and so do we now."""
    resolved = _train_dry_run_of_yaml(
        model_dir, tmp_path, capsys, f"data: [{model_dir / 'data.txt'}]\nlr: 1e-3\nweight_decay: 2E-2\n"
    )
    assert resolved["lr"] == 1e-3 and resolved["weight_decay"] == 2e-2
    study = tmp_path / "study.yaml"
    study.write_text("lr: 5e-4\n")
    assert main(["study", "--config", str(study), "--output-dir", str(tmp_path / "s"), "--dry-run"]) == 0


def test_train_dry_run_output_is_a_config_that_reproduces_it(model_dir, tmp_path, capsys):
    argv = ["train", "--model", str(model_dir / "model"), "--output-dir", str(tmp_path / "o")]
    argv += ["--data", str(model_dir / "data.txt"), "--encoding", "alibi", "--max-steps", "3"]
    assert main([*argv, "--dry-run"]) == 0
    first = capsys.readouterr().out
    (tmp_path / "run.json").write_text(first)
    assert main(["train", "--config", str(tmp_path / "run.json"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(first)


def test_train_dry_run_loads_no_model_and_no_data(model_dir, tmp_path):
    """In a fresh interpreter: no transformers model class and no datasets module is imported
    (the model's config class is: the encoding is checked against the checkpoint's config)."""
    argv = ["train", "--model", str(model_dir / "model"), "--output-dir", str(tmp_path / "o")]
    argv += ["--data", str(model_dir / "data.txt"), "--dry-run"]
    code = (
        "import sys; from hf_posenc.recipes.cli import main; rc = main(sys.argv[1:]); "
        "print('LOADED', sorted(m for m in sys.modules if m.startswith(('datasets', "
        "'transformers.models.llama.modeling_llama')))); sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout, out.stdout


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ("train:\n  modle: x\n", "unknown setting(s) modle"),
        ("train: [1, 2\n", "is not valid YAML/JSON"),
        ("train:\n  output_dir: out\n", "--model is required"),
    ],
)
def test_train_config_file_errors_are_one_line(tmp_path, contents, message, capsys):
    (tmp_path / "bad.yaml").write_text(contents)
    with pytest.raises(SystemExit) if "required" in message else _no_raise():
        code = main(["train", "--config", str(tmp_path / "bad.yaml"), "--dry-run"])
        assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err.splitlines()[-1], err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_study_config_file_flags_given_win_even_at_their_default(tmp_path, capsys):
    """--steps 300 is the default; given on the command line it still beats the file's 5."""
    (tmp_path / "study.yaml").write_text("study:\n  steps: 5\n  pretrain_steps: 2\n  encodings: [alibi]\n")
    argv = ["study", "--config", str(tmp_path / "study.yaml"), "--output-dir", str(tmp_path / "s")]
    assert main([*argv, "--steps", "300", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "300 steps" in out and "2 steps" in out, out
