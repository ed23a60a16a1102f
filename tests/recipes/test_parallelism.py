"""Sequence / context parallelism through accelerate's ParallelismConfig: every combination
hf-posenc train cannot serve stops in one line before anything loads, and the README's
engine/encoding table is what the check answers for every encoding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hf_posenc
from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training import TrainConfig
from hf_posenc.recipes.training.parallel import (
    check_context_parallel_encoding,
    check_parallelism,
    parallel_sizes,
)

ROOT = Path(__file__).resolve().parents[2]


def env(**sizes) -> dict[str, str]:
    return {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        **{f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in sizes.items()},
    }


def config(**overrides) -> TrainConfig:
    return TrainConfig(model="m", output_dir="o", seq_len=64, **overrides)


def test_sizes_come_from_what_accelerate_launch_exports():
    assert parallel_sizes({}) == {"cp_size": 1, "sp_size": 1, "sp_backend": None}
    assert parallel_sizes(env(cp_size=2))["cp_size"] == 2
    check_parallelism(config(), {})  # no parallelism config: nothing to refuse


@pytest.mark.parametrize(
    ("environ", "overrides", "cuda", "message"),
    [
        (env(sp_size=2, sp_backend="deepspeed"), {}, True, r"sequence parallelism \(sp_size=2.*head offset"),
        (env(cp_size=2), {"packing": True}, True, r"cp_size=2\) with --packing is not allowed"),
        (
            env(cp_size=2),
            {"position_sampling": "pose", "target_length": 128},
            True,
            r"with --position-sampling pose is not allowed",
        ),
        (env(cp_size=3), {}, True, r"--seq-len 64 is not divisible by 2 x cp_size = 6"),
        (env(cp_size=2), {}, False, r"needs CUDA GPUs"),
    ],
)
def test_every_unsupported_parallelism_stops_in_one_line(environ, overrides, cuda, message):
    with pytest.raises(InvalidParameterError, match=message) as error:
        check_parallelism(config(**overrides), environ, cuda=cuda)
    assert "\n" not in str(error.value)


def test_shipped_configs_carry_the_parallel_sizes():
    from accelerate.commands.config.config_args import load_config_from_file

    cp = load_config_from_file(str(ROOT / "recipes/accelerate/cp_fsdp2.yaml"))
    sp = load_config_from_file(str(ROOT / "recipes/accelerate/sp_deepspeed.yaml"))
    assert cp.parallelism_config["parallelism_config_cp_size"] == 2 and cp.fsdp_config["fsdp_version"] == 2
    assert sp.parallelism_config["parallelism_config_sp_backend"] == "deepspeed"


def test_the_readme_table_is_what_the_check_answers_for_every_encoding():
    """README's 'Sequence and context parallelism' table: CP 'yes' exactly for the encodings
    check_context_parallel_encoding accepts (with their defaults), Ulysses 'no' for all."""
    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (yes|no)[^|]*\| no[^|]*\|$", text, flags=re.M))
    names = {info.name for info in hf_posenc.list_encodings()}
    assert set(rows) == names
    for name in names:
        model = hf_posenc.patch_model(tiny_model("llama"), name)
        try:
            check_context_parallel_encoding(model.posenc, 2)
            accepted = "yes"
        except InvalidParameterError:
            accepted = "no"
        assert rows[name] == accepted, name


def test_train_under_a_context_parallel_launch_stops_before_anything_loads(tmp_path, monkeypatch, capsys):
    from hf_posenc.recipes.cli import main
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(["some text to train on"] * 20, vocab_size=300)
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    (tmp_path / "data.txt").write_text("some text " * 50)
    for key, value in env(cp_size=2).items():
        monkeypatch.setenv(key, value)
    argv = ["train", "--model", str(tmp_path / "base")]
    argv += ["--output-dir", str(tmp_path / "run"), "--data", str(tmp_path / "data.txt"), "--seq-len", "64"]
    code = main(argv)
    err = capsys.readouterr().err
    # train's preflight names the launch config's degree as the flag it stands for (parallelism.py)
    assert code != 0 and ("context parallelism (cp_size=2)" in err or "--context-parallel 2" in err)
    assert not (tmp_path / "run").exists()
