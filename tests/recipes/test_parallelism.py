"""Sequence / context parallelism through accelerate's ParallelismConfig: every combination
hf-posenc train cannot serve stops in one line before anything loads, and the README's
engine/encoding table is what the check answers for every encoding."""

from __future__ import annotations

import re
from pathlib import Path

import hf_posenc
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training.parallelism import (
    engine_refusal,
    model_encodings,
    model_forms,
    sequence_parallel_refusal,
)

ROOT = Path(__file__).resolve().parents[2]


def env(**sizes) -> dict[str, str]:
    return {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        **{f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in sizes.items()},
    }


def test_shipped_configs_carry_the_parallel_sizes():
    from accelerate.commands.config.config_args import load_config_from_file

    cp = load_config_from_file(str(ROOT / "recipes/accelerate/cp_fsdp2.yaml"))
    sp = load_config_from_file(str(ROOT / "recipes/accelerate/ulysses.yaml"))
    assert cp.parallelism_config["parallelism_config_cp_size"] == 2 and cp.fsdp_config["fsdp_version"] == 2
    assert sp.distributed_type == "DEEPSPEED"


def test_the_readme_table_is_what_the_check_answers_for_every_encoding():
    """README's 'Sequence and context parallelism' table: CP 'yes' exactly for the encodings
    the context-parallel engine serves (asked of the patched model's attention forms, with their
    defaults), Ulysses 'yes' exactly for those head-parallel attention serves."""
    text = (ROOT / "README.md").read_text()
    rows = {
        name: (cp, sp)
        for name, cp, sp in re.findall(r"^\| `(\w+)` \| (yes|no)[^|]*\| (yes|no)[^|]*\|$", text, flags=re.M)
    }
    names = {info.name for info in hf_posenc.list_encodings()}
    assert set(rows) == names
    for name in names:
        model = hf_posenc.patch_model(tiny_model("llama"), name)
        served = engine_refusal("context_parallel", model_forms(model)) is None
        assert rows[name][0] == ("yes" if served else "no"), name
        ulysses = sequence_parallel_refusal(model_encodings(model)) is None
        assert rows[name][1] == ("yes" if ulysses else "no"), name


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
