"""Every subcommand fails the same way on bad input: one line naming the bad value, exit code 2,
before any model loads; --traceback shows the traceback instead. --help and list stay cheap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_posenc
from hf_posenc.recipes.cli import build_parser, main
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-errors")
    documents = list(stdlib_documents())[:4]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=320)
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(root / "no-tokenizer")
    (root / "data.txt").write_text(documents[0])
    return root


def commands(root: Path, model: str, encoding: list[str]) -> dict[str, list[str]]:
    out = str(root / "out")
    data = str(root / "data.txt")
    return {
        "train": ["train", "--model", model, "--output-dir", out, "--data", data, *encoding],
        "study": [
            "study",
            "--base-model",
            model,
            "--output-dir",
            out,
            "--data",
            data,
            "--encodings",
            "alibi",
        ],
        "perplexity": ["perplexity", "--model", model, "--data", data, "--train-length", "8", "--output", out]
        + encoding,
    }


BAD_PARAMETER = ["--encoding", "t5", "--encoding-param", "num_buckets=-3"]


def _lm_eval(root: Path, model: str, encoding: list[str]) -> list[str]:
    args = f"pretrained={model}"
    if encoding:
        args += f",encoding={encoding[1]}" + (f",{encoding[3]}" if len(encoding) > 2 else "")
    return ["lm-eval", "--tasks", "arc_easy", "--model_args", args, "--output", str(root / "out")]


CASES = {
    "missing local model": ("./my-llama", [], "'./my-llama' does not exist"),
    "model without tokenizer": ("{root}/no-tokenizer", [], "has no tokenizer"),
    "typo in the encoding": ("{root}/model", ["--encoding", "alibbi"], "Did you mean 'alibi'"),
    "bad parameter": ("{root}/model", BAD_PARAMETER, "num_buckets"),
}


@pytest.mark.parametrize("command", ["train", "study", "perplexity", "lm-eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_before_any_model_loads(model_dir, command, case, capsys):
    model, encoding, message = CASES[case]
    model = model.format(root=model_dir)
    if command == "study" and encoding:
        spec = encoding[1] + ('{"num_buckets": -3}' if len(encoding) > 2 else "")
        argv = ["study", "--base-model", model, "--output-dir", str(model_dir / "out")]
        argv += ["--data", str(model_dir / "data.txt"), "--encodings", spec]
    elif command == "lm-eval":
        argv = _lm_eval(model_dir, model, encoding)
    else:
        argv = commands(model_dir, model, encoding)[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"hf-posenc {command}: error:") and message in errors[0], err
    assert not (model_dir / "out" / "final").exists()


def test_traceback_flag_is_accepted_by_every_subcommand_and_shows_the_traceback(model_dir):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    for name, subparser in subcommands.items():
        if name != "lm-eval":
            assert "--traceback" in subparser._option_string_actions, name
    with pytest.raises(FileNotFoundError, match="my-llama"):
        main(["train", "--model", "./my-llama", "--output-dir", str(model_dir / "o"), "--traceback"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--lengths", "0"], "--lengths 0 is not allowed; allowed: integers >= 2"),
        (["bench", "--device", "cuda:7"], "--device cuda:7"),
        (["bench", "--encodings", "alibbi", "--lengths", "8"], "Did you mean 'alibi'"),
        (["bench", "--backend", "fast"], "--backend 'fast' is not allowed"),
        (["bench", "--vocab-size", "0"], "--vocab-size 0 is not allowed; allowed: >= 1"),
        (
            ["bench", "--modes", "forward", "--train-lengths", "64", "--freeze-encoding"],
            "error: --train-lengths, --freeze-encoding without the train mode would be ignored; allowed: add train",
        ),
        (["bench", "--modes", "train", "--decode-tokens", "4"], "--decode-tokens without the decode mode"),
        (
            ["bench", "--hidden-size", "30", "--num-heads", "4"],
            "not a multiple of the number of attention heads",
        ),
        (
            ["bench", "--family", "qwen2", "--hidden-size", "28", "--num-heads", "4"],
            "the native model's rotary dimension",
        ),
        (
            [
                "bench",
                "--family",
                "gpt2",
                "--hidden-size",
                "20",
                "--num-heads",
                "4",
                "--encodings",
                "alibi",
                "rope",
            ],
            "rope: rotary dimension",
        ),
    ],
)
def test_bench_bad_input_is_one_line(argv, message, capsys, tmp_path):
    """... before any row is measured: nothing on stdout, nothing written."""
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert "[bench]" not in captured.out and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["bench", "longeval", "perplexity"])
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device 'tpu' is not a device; allowed: cpu, cuda, cuda:N, mps"),
        ("cuda:x", "--device 'cuda:x' is not a device"),
        ("meta", "--device 'meta' is not allowed; allowed: cpu, cuda, cuda:N, mps"),
    ],
)
def test_a_device_that_is_none_is_one_line_in_every_command_that_takes_one(
    model_dir, command, device, message, capsys
):
    """One check for every --device (bench's said so; longeval and perplexity passed a name torch
    cannot read to torch.device: a RuntimeError traceback)."""
    model = str(model_dir / "model")
    out = str(model_dir / f"out-{command}-{device}")
    argv = {
        "bench": ["bench", "--output-dir", out],
        "longeval": ["longeval", "--model", model, "--output-dir", out],
        "perplexity": [*commands(model_dir, model, [])["perplexity"][:-2], "--output", out],
    }[command]
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_flag_names_are_shared_across_subcommands():
    """--output-dir (alias --output) everywhere; --seq-len and --train-length name the same value."""
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    for name in ("train", "study", "perplexity", "bench"):
        options = subcommands[name]._option_string_actions
        assert "--output-dir" in options and "--output" in options, name
    for name in ("train", "study", "perplexity"):
        options = subcommands[name]._option_string_actions
        assert options["--seq-len"] is options["--train-length"], name


def test_the_command_line_imports_no_heavy_module_of_its_own():
    """Importing the CLI adds no torch-, accelerate-, datasets-, matplotlib- or lm-eval-dependent
    module of hf_posenc to what `import hf_posenc` already loads (--help does not wait for them)."""
    code = (
        "import sys, hf_posenc; before = set(sys.modules); import hf_posenc.recipes.cli; "
        "print(sorted(set(sys.modules) - before))"
    )
    added = eval(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    heavy = (
        "accelerate",
        "datasets",
        "matplotlib",
        "lm_eval",
        "hf_posenc.recipes.training.loop",
        "hf_posenc.recipes.benchmark.suite",
    )
    assert not [m for m in added if m.startswith(heavy)], added


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ("pretrained=./my-llama", "'./my-llama' does not exist"),
        ("pretrained={root}/no-tokenizer", "has no tokenizer"),
        ("pretrained={root}/model,encoding=alibbi", "Did you mean 'alibi'"),
    ],
)
def test_lm_eval_passthrough_checks_the_model_before_lm_eval_starts(
    model_dir, model_args, message, capsys, monkeypatch
):
    import hf_posenc.recipes.cli.lm_eval as command

    monkeypatch.setattr(command, "run_lm_eval_cli", lambda argv: pytest.fail("lm-eval started"))
    argv = ["lm-eval", "--model", "hf-posenc", "--model_args", model_args.format(root=model_dir)]
    assert main([*argv, "--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


@pytest.mark.slow  # multi-second; CI runs it
def test_list_reads_a_cached_catalogue_without_importing_torch(tmp_path):
    """`hf-posenc list` builds its catalogue once (importing the registry) and afterwards prints it
    from the cache without importing torch; the printed catalogue is the registry's own listing;
    a damaged cache file is rebuilt."""
    env = {**os.environ, "HF_POSENC_CACHE": str(tmp_path)}
    code = (
        "import sys; from hf_posenc.recipes.cli import main; main(['list', '--json']); "
        "print('TORCH', 'torch' in sys.modules)"
    )

    def run() -> tuple[dict, bool]:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        listing, _, flag = out.stdout.rpartition("TORCH ")
        return json.loads(listing), flag.strip() == "True"

    first, first_imported_torch = run()
    (cached,) = tmp_path.glob("catalogue-*.json")
    second, second_imported_torch = run()
    assert first_imported_torch and not second_imported_torch
    assert first == second
    names = [info.name for info in hf_posenc.list_encodings()]
    assert [row["name"] for row in second["encodings"]] == names
    assert second["families"] == hf_posenc.core.registry.supported_families()
    params = {row["name"]: row["parameters"] for row in second["encodings"]}
    assert params["t5"] == json.loads(
        json.dumps(hf_posenc.core.registry.get_encoding("t5").config_class.parameter_defaults())
    )
    cached.write_text("{not json")
    third, third_imported_torch = run()
    assert third == first and third_imported_torch
