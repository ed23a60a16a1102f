"""Training data through 🤗 datasets: the memory-mapped blocks equal packing the whole token
stream in memory (the reference: tokenize_documents + pack_blocks), across Arrow chunk
boundaries and worker processes; the tokenisation is cached and redone when a file changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_posenc.recipes.data import pack_blocks, read_documents, stdlib_documents, tokenize_documents
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer
from hf_posenc.recipes.training.corpus import BATCH_DOCUMENTS, TokenBlocks, training_blocks


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(list(stdlib_documents())[:6], vocab_size=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """More documents than one Arrow chunk holds, of uneven lengths."""
    root = tmp_path_factory.mktemp("corpus")
    text = next(iter(stdlib_documents()))
    with open(root / "rows.jsonl", "w") as handle:
        for i in range(2 * BATCH_DOCUMENTS + 37):
            handle.write(
                json.dumps({"text": text[(i * 97) % 3000 : (i * 97) % 3000 + 50 + 13 * (i % 29)]}) + "\n"
            )
    (root / "extra.txt").write_text(text[:5000])
    return root


def reference(sources, tokenizer, length):
    return pack_blocks(tokenize_documents(read_documents(sources), tokenizer), length)


@pytest.mark.parametrize("num_proc", [None, 2])
def test_blocks_equal_packing_the_whole_stream_in_memory(corpus, tokenizer, tmp_path, num_proc):
    sources = [str(corpus / "rows.jsonl"), str(corpus / "extra.txt")]
    blocks = training_blocks(sources, tokenizer, 33, cache_dir=tmp_path, num_proc=num_proc)
    expected = reference(sources, tokenizer, 33)
    assert blocks.shape == tuple(expected.shape)
    every = torch.arange(len(blocks))
    assert torch.equal(blocks[every], expected)
    assert torch.equal(blocks[torch.tensor([5, 0, 5])], expected[[5, 0, 5]])


def test_tokenisation_is_cached_and_redone_when_a_file_changes(corpus, tokenizer, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text((corpus / "rows.jsonl").read_text())
    training_blocks([str(data)], tokenizer, 16, cache_dir=tmp_path / "cache")
    cached = sorted((tmp_path / "cache").glob("tokens-*.arrow"))
    assert len(cached) == 1
    again = training_blocks([str(data)], tokenizer, 16, cache_dir=tmp_path / "cache")
    assert sorted((tmp_path / "cache").glob("tokens-*.arrow")) == cached
    with data.open("a") as handle:
        handle.write(json.dumps({"text": "one more document " * 20}) + "\n")
    changed = training_blocks([str(data)], tokenizer, 16, cache_dir=tmp_path / "cache")
    assert len(changed) > len(again)
    assert torch.equal(changed[torch.arange(len(changed))], reference([str(data)], tokenizer, 16))


def test_hub_sources_go_through_load_dataset_with_the_text_field(monkeypatch, tokenizer, tmp_path):
    """hf:NAME:CONFIG is read with datasets.load_dataset (stubbed here: no network in tests);
    empty documents are dropped, the chosen column is the text, a missing column is named."""
    import datasets

    rows = {"content": ["first document " * 9, "   ", "second one " * 7], "id": [1, 2, 3]}
    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    blocks = training_blocks(
        ["hf:org/corpus:sample"], tokenizer, 8, text_field="content", split="train", cache_dir=tmp_path
    )
    assert calls == [("org/corpus", "sample", "train")]
    ids = [
        i
        for text in (rows["content"][0], rows["content"][2])
        for i in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]
    ]
    expected = torch.tensor(ids[: len(ids) // 8 * 8]).view(-1, 8)
    assert torch.equal(blocks[torch.arange(len(blocks))], expected)
    with pytest.raises(ValueError, match="no column 'text' \\(columns: content, id\\)"):
        training_blocks(["hf:org/corpus"], tokenizer, 8, cache_dir=tmp_path)


def test_too_little_data_for_one_block_says_how_much_there_is(tmp_path, tokenizer):
    (tmp_path / "tiny.txt").write_text("short")
    with pytest.raises(ValueError, match="tokens in the data: not enough for one block of 512"):
        training_blocks([str(tmp_path / "tiny.txt")], tokenizer, 512, cache_dir=tmp_path / "c")


def test_token_blocks_is_a_read_only_view(corpus, tokenizer, tmp_path):
    blocks = training_blocks([str(corpus / "rows.jsonl")], tokenizer, 20, cache_dir=tmp_path)
    assert isinstance(blocks, TokenBlocks)
    with pytest.raises(IndexError):
        blocks.block(len(blocks))
