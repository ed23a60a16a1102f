"""The extrapolation study end to end on a miniature configuration (the real default is
the same code with bigger numbers), its reuse of finished runs, and its early errors."""

from __future__ import annotations

import json

import pytest

import hf_posenc
from hf_posenc.cli import main
from hf_posenc.study import StudyConfig, parse_encoding_spec, run_study

MINI = dict(
    encodings=["rope", "alibi", 'expe{"scaling": {"type": "linear", "factor": 2}}'],
    train_length=16,
    multiples=[1, 2, 4],
    steps=2,
    pretrain_steps=3,
    batch_size=4,
    eval_tokens=256,
    vocab_size=300,
    hidden_size=32,
    num_layers=1,
    max_documents=12,
)


def test_default_study_runs_offline_and_writes_the_report(tmp_path, capsys):
    """Embedded default (stdlib corpus, BPE tokenizer, RoPE-pretrained tiny Llama): one row per
    encoding plus the base, one column per evaluation length, table/CSV/JSON/PNG on disk."""
    paths = run_study(StudyConfig(output_dir=str(tmp_path), **MINI))
    out = capsys.readouterr().out
    assert set(paths) == {"table", "csv", "json", "png"}
    assert paths["png"].read_bytes().startswith(b"\x89PNG")
    report = json.loads(paths["json"].read_text())
    text = paths["table"].read_text()
    for label in ["rope (base, no further training)", "rope", "alibi", MINI["encodings"][2]]:
        assert label in text and label in out
    assert "loss (ev=4)" in text
    assert report  # machine-readable copy of the same numbers
    # every run is a reloadable patched checkpoint
    alibi = hf_posenc.from_pretrained(str(tmp_path / "runs" / "alibi" / "final"))
    assert hf_posenc.patch_info(alibi)["encoding"] == "alibi"
    expe_dir = tmp_path / "runs" / "expe_scaling_type_linear_factor_2"
    assert expe_dir.is_dir(), sorted(p.name for p in (tmp_path / "runs").iterdir())


def test_a_second_run_reuses_finished_models(tmp_path, capsys):
    run_study(StudyConfig(output_dir=str(tmp_path), **{**MINI, "encodings": ["alibi"]}))
    capsys.readouterr()
    run_study(StudyConfig(output_dir=str(tmp_path), **{**MINI, "encodings": ["alibi"]}))
    out = capsys.readouterr().out
    assert "reusing the pretrained base model" in out and "reusing alibi" in out


def test_encoding_specs_parse_names_aliases_and_json():
    assert parse_encoding_spec("rotary") == ("rope", {})
    assert parse_encoding_spec('t5{"num_buckets": 8}') == ("t5", {"num_buckets": 8})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encodings", "alibbi"], "Did you mean 'alibi'"),
        (["--encodings", "expe{oops"], "not JSON"),
        (["--data", "no/such/file.txt"], "no/such/file.txt"),
    ],
)
def test_bad_input_is_refused_before_any_training(tmp_path, capsys, argv, message):
    code = main(["study", "--output-dir", str(tmp_path / "out"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "base").exists()


def test_unwritable_output_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["study", "--output-dir", str(tmp_path / "file")]) == 2
    assert "file" in capsys.readouterr().err
