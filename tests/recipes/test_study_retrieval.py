"""The study's retrieval experiment (off by default): passkey documents of one training block each,
listed first in every pretraining's data, then passkey accuracy of every row at 1x..kx the training
length in a second table, retrieval.json and retrieval_heatmaps.png."""

from __future__ import annotations

import json

import pytest

from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.study import StudyConfig, run_study
from hf_posenc.recipes.study.runs import plan_study


def test_off_by_default_and_the_default_study_reads_the_same_data(tmp_path):
    config = StudyConfig(output_dir=str(tmp_path))
    assert config.retrieval_documents == 0
    assert all(settings.data == list(config.data) for _, settings, _ in plan_study(config))
    on = StudyConfig(output_dir=str(tmp_path), retrieval_documents=10)
    assert all(
        settings.data[0] == str(tmp_path / "retrieval" / "train.jsonl") for _, settings, _ in plan_study(on)
    )
    with pytest.raises(InvalidParameterError, match="retrieval_documents=-1 is not allowed"):
        StudyConfig(retrieval_documents=-1)


@pytest.mark.slow  # a miniature study: multi-second
def test_a_study_with_retrieval_documents_reports_passkey_accuracy(tmp_path, capsys):
    mini = dict(
        encodings=["rope", "alibi"],
        train_length=256,
        multiples=[1, 2],
        steps=2,
        pretrain_steps=3,
        batch_size=4,
        eval_tokens=512,
        vocab_size=300,
        hidden_size=32,
        num_layers=1,
        max_documents=12,
        eval_only=[],
        retrieval_documents=12,
        retrieval_samples=1,
    )
    paths = run_study(StudyConfig(output_dir=str(tmp_path), **mini))
    assert "Passkey retrieval" in capsys.readouterr().out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base" / "final")
    documents = [
        json.loads(line)["text"] for line in (tmp_path / "retrieval" / "train.jsonl").read_text().splitlines()
    ]
    assert len(documents) == 12
    for text in documents:  # one whole training block with the end-of-text token the pipeline adds
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 255
    assert paths["json"].name == "results.json" and paths["retrieval json"].name == "retrieval.json"
    retrieval = json.loads(paths["retrieval json"].read_text())
    assert len(retrieval["results"]) == 3  # the base and two encodings
    for cells in retrieval["results"].values():
        overall = {c["length"]: c for c in cells if c["depth"] is None}
        assert sorted(overall) == [256, 512]
        assert all(c["prompt_tokens"] == c["length"] - 16 for c in overall.values())
    assert (tmp_path / "retrieval_heatmaps.png").read_bytes().startswith(b"\x89PNG")


@pytest.fixture(scope="module")
def passkey_tokenizer():
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    return train_bpe_tokenizer([text * 20, "pass key 0123456789 remember it " * 20], vocab_size=300)


def test_reused_passkey_documents_are_verified(tmp_path, passkey_tokenizer):
    """The documents are written once and reused by every later pretraining (and a resumed study):
    a file damaged in place (same size), truncated, or written for other settings stops the
    study with one line naming it and the fix; an intact one is reused as it is. Before, any file
    at that path was used without a look."""
    from hf_posenc.recipes.data import DataError
    from hf_posenc.recipes.study.retrieval import write_training_documents

    config = StudyConfig(output_dir=str(tmp_path), retrieval_documents=2, train_length=256)
    path = write_training_documents(config, passkey_tokenizer)
    written = path.read_bytes()
    assert write_training_documents(config, passkey_tokenizer) == path and path.read_bytes() == written

    flipped = bytearray(written)
    flipped[len(flipped) // 2] ^= 0x01  # one bit, the size unchanged
    path.write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=rf"^{path}: .*SHA-256.*rm {path} "):
        write_training_documents(config, passkey_tokenizer)
    path.write_bytes(written[:-10])
    with pytest.raises(DataError, match=rf"^{path}: .*bytes where {len(written)} were written"):
        write_training_documents(config, passkey_tokenizer)
    path.write_bytes(written)
    other = StudyConfig(output_dir=str(tmp_path), retrieval_documents=3, train_length=256)
    with pytest.raises(
        DataError, match=r"written for .*'retrieval_documents': 2.*asks for .*'retrieval_documents': 3"
    ):
        write_training_documents(other, passkey_tokenizer)
    assert write_training_documents(config, passkey_tokenizer) == path and path.read_bytes() == written
