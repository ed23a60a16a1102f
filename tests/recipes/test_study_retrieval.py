"""The study's retrieval experiment (on by default, in the setting tuned for the embedded default):
passkey documents of one training block each, listed first in every pretraining's data, then passkey
accuracy of every row at 1x..kx the training length in a second table, retrieval.json and
retrieval_heatmaps.png."""

from __future__ import annotations

import json

import pytest

from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.longeval.task import Instance, Task
from hf_posenc.recipes.study import StudyConfig, run_study
from hf_posenc.recipes.study.runs import plan_study

#: the tuned setting as README documents it ("The extrapolation study"; the tuning log): 25000 passkey
#: documents (about half the training blocks), keys 1-99, no instruction line, 4 prompts per cell
DOCUMENTED_DEFAULT = {
    "retrieval_documents": 25000,
    "retrieval_max_key": 99,
    "retrieval_instruction": False,
    "retrieval_samples": 4,
}


def test_the_default_study_is_the_tuned_retrieval_setting(tmp_path, monkeypatch):
    """The study's defaults, as a config and on the command line, are the documented tuned values,
    and its every pretraining lists the passkey documents first; ``--retrieval-documents 0`` reads the
    corpus alone (the study before the retrieval experiment)."""
    from hf_posenc.recipes.cli import main
    from hf_posenc.recipes.cli import study as cli_study

    config = StudyConfig(output_dir=str(tmp_path))
    assert {name: getattr(config, name) for name in DOCUMENTED_DEFAULT} == DOCUMENTED_DEFAULT
    seen = []
    monkeypatch.setattr(cli_study, "run_study", lambda config, **_: seen.append(config))
    assert main(["study", "--output-dir", str(tmp_path)]) == 0
    assert {name: getattr(seen[-1], name) for name in DOCUMENTED_DEFAULT} == DOCUMENTED_DEFAULT
    documents = str(tmp_path / "retrieval" / "train.jsonl")
    plan = plan_study(config)
    assert len(plan) == 1 + len(config.encodings)  # the base and every encoding
    assert all(settings.data == [documents, *config.data] for _, settings, _ in plan)
    off = StudyConfig(output_dir=str(tmp_path), retrieval_documents=0)
    assert all(settings.data == list(off.data) for _, settings, _ in plan_study(off))
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
    # the same command again: every run reused (their recorded tokens, passkey documents included,
    # are the data's now)
    capsys.readouterr()
    run_study(StudyConfig(output_dir=str(tmp_path), **mini))
    out = capsys.readouterr().out
    assert all(f"{label}: reusing" in out for label in ("base (RoPE pretraining)", "rope", "alibi")), out


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


def test_passkey_documents_for_other_keys_or_prompt_stop_the_study(tmp_path, passkey_tokenizer):
    """The key range and the instruction line shape the documents too: documents written for keys
    1-99 are refused for a study asking for keys 1-50000 or for no instruction line (one line with
    the fix); the protocol's values are not recorded, so records from before stay valid."""
    from hf_posenc.recipes.data import DataError
    from hf_posenc.recipes.study.retrieval import RECORD, write_training_documents

    protocol_prompt = {"retrieval_max_key": 50000, "retrieval_instruction": True}
    config = StudyConfig(
        output_dir=str(tmp_path),
        retrieval_documents=2,
        train_length=256,
        **{**protocol_prompt, "retrieval_max_key": 99},
    )
    path = write_training_documents(config, passkey_tokenizer)
    assert json.loads(path.with_name(RECORD.name).read_text())["settings"]["retrieval_max_key"] == 99
    for other in ({"retrieval_max_key": 50000}, {"retrieval_max_key": 99, "retrieval_instruction": False}):
        asked = StudyConfig(
            output_dir=str(tmp_path), retrieval_documents=2, train_length=256, **{**protocol_prompt, **other}
        )
        with pytest.raises(DataError, match=r"written for .*asks for"):
            write_training_documents(asked, passkey_tokenizer)
    protocol = StudyConfig(
        output_dir=str(tmp_path / "p"), retrieval_documents=2, train_length=256, **protocol_prompt
    )
    written = write_training_documents(protocol, passkey_tokenizer)
    assert set(json.loads(written.with_name(RECORD.name).read_text())["settings"]) == {
        "retrieval_documents",
        "train_length",
        "seed",
    }


@pytest.mark.parametrize("instruction", [True, False])
def test_the_study_passkey_draws_keys_in_its_range_with_or_without_the_instruction_line(instruction):
    """``Passkey(max_key, instruction)``: Landmark's filler, key line and question, keys in [1, max_key]
    (the reference solver reads them back), the instruction line only when asked; the protocol's
    default is keys in [1, 50000] with the line."""
    from longeval_reference import bpe_tokenizer, solve

    from hf_posenc.recipes.longeval.passkey import Passkey
    from hf_posenc.recipes.longeval.tasks import task_samples

    tokenizer = bpe_tokenizer()
    instruction_line = "There is an important info hidden inside a lot of irrelevant text."
    samples = list(task_samples(Passkey(9, instruction), tokenizer, 150, [0.0, 0.5, 1.0], 12, seed=0))
    for sample in samples:
        assert len(tokenizer(sample.prompt)["input_ids"]) == 150
        assert solve(sample.prompt) == [sample.answers[0]] and 1 <= int(sample.answers[0]) <= 9
        assert (instruction_line in sample.prompt) is instruction
        assert "The grass" in sample.prompt  # the filler (what is left of it at 150 tokens)
        assert sample.prompt.endswith("What is the pass key? The pass key is")
    protocol = list(task_samples(Passkey(), tokenizer, 150, [0.5], 40, seed=0))
    assert all(instruction_line in s.prompt for s in protocol)
    assert max(int(s.answers[0]) for s in protocol) > 999  # keys up to 50000
    with pytest.raises(InvalidParameterError, match="max_key=0 is not allowed"):
        Passkey(0)


class _Parity(Task):
    """A passkey-like task whose prompts of odd keys have an even number of characters only (the way
    a tokenizer can jump over a length): ``"ab" * size + "??"``; even keys fit any length."""

    name = "parity"
    description = "test task"
    citation = "none"
    metric = "first_integer"
    max_new_tokens = 4

    def __init__(self, odd_only: bool = False) -> None:
        self.odd_only = odd_only

    def instance(self, rng, length, depth):
        key = rng.randint(1, 9) | (1 if self.odd_only else 0)
        jumps = key % 2 == 1

        def render(size, pad):
            return ("ab" * size + "??") if jumps else ("a" * size + "?")

        return Instance(render, (str(key),))


def test_training_documents_skip_draws_no_prompt_fits_and_still_have_the_asked_length():
    """A draw whose prompt cannot have exactly the length left for the answer is skipped: every
    document has the asked length (one character = one token here) and the count is kept; a task
    that never fits is refused after SKIP_LIMIT draws in a row."""
    from longeval_reference import char_level_tokenizer

    from hf_posenc.recipes.longeval.fit import PromptLengthError
    from hf_posenc.recipes.longeval.training_data import SKIP_LIMIT, hash_seed, training_documents
    from hf_posenc.recipes.longeval.words import sample_rng

    tokenizer = char_level_tokenizer()
    # 40 characters: a prompt of 37 and " k." -- odd keys only make prompts of even length
    documents = list(training_documents(_Parity(), tokenizer, 40, 6, seed=0))
    drawn = [_Parity().instance(sample_rng(hash_seed(0), "parity", i), 40, 0.5).answers[0] for i in range(6)]
    assert any(int(key) % 2 for key in drawn)  # some of the first six draws were skipped
    assert len(documents) == 6
    for document in documents:
        assert len(document) == 40 and int(document[-2]) % 2 == 0
    with pytest.raises(PromptLengthError):
        list(training_documents(_Parity(odd_only=True), tokenizer, 40, 1, seed=0))
    assert SKIP_LIMIT >= 8


def test_evaluation_prompts_are_a_token_shorter_where_the_length_cannot_be_met():
    """The study scores prompts of length - ANSWER_ROOM tokens, or the next shorter length every
    sample meets (never longer, so prompt and answer stay within the evaluation length)."""
    from longeval_reference import char_level_tokenizer

    from hf_posenc.recipes.study.retrieval import ANSWER_ROOM, DEPTHS, evaluation_samples

    tokenizer = char_level_tokenizer()
    tokens, samples = evaluation_samples(_Parity(odd_only=True), tokenizer, 51, 2, seed=0)
    assert 51 - ANSWER_ROOM == 35 and tokens == 34  # odd keys: even lengths only
    assert len(samples) == 2 * len(DEPTHS) and all(len(s.prompt) == 34 for s in samples)
    tokens, samples = evaluation_samples(_Parity(), tokenizer, 50, 2, seed=1)
    assert tokens == 34 and all(len(s.prompt) == 34 for s in samples)


def test_the_retrieval_flag_of_before_changes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    """``study --retrieval`` chose the tuned setting before it became the default: it still runs, gives
    the same settings as no flag (flags given and --config values win as over any default) and says
    in one line that it changes nothing."""
    from hf_posenc.recipes.cli import main
    from hf_posenc.recipes.cli import study as cli_study

    seen = []
    monkeypatch.setattr(cli_study, "run_study", lambda config, **_: seen.append(config))
    out = str(tmp_path / "s")
    assert main(["study", "--output-dir", out]) == 0
    assert "--retrieval" not in capsys.readouterr().out
    assert main(["study", "--output-dir", out, "--retrieval"]) == 0
    assert seen[-1] == seen[-2]
    note = capsys.readouterr().out
    assert "--retrieval changes nothing" in note and "default now" in note and len(note.splitlines()) == 1
    assert main(["study", "--output-dir", out, "--retrieval", "--retrieval-max-key", "50000"]) == 0
    assert (seen[-1].retrieval_documents, seen[-1].retrieval_max_key) == (25000, 50000)
    (tmp_path / "study.yaml").write_text("study:\n  retrieval_documents: 0\n  retrieval_instruction: true\n")
    assert main(["study", "--output-dir", out, "--retrieval", "--config", str(tmp_path / "study.yaml")]) == 0
    assert (seen[-1].retrieval_documents, seen[-1].retrieval_instruction) == (0, True)


def _shortest_passkey_prompt(config: StudyConfig) -> str:
    """The passkey prompt the study's documents start from, with no haystack (the first draw)."""
    from hf_posenc.recipes.longeval.words import sample_rng
    from hf_posenc.recipes.study.retrieval import study_task

    task = study_task(config)
    return task.instance(sample_rng(config.seed, task.name, 0), config.train_length, 0.5).render(0, 0)


def test_a_training_length_too_short_for_passkey_documents_stops_before_any_work(tmp_path, capsys):
    """``--train-length`` below what any byte-level BPE tokenizer needs for the passkey prompt is
    refused in one line naming the value, before a tokenizer is trained or a file is written
    (before, the refusal came after the tokenizer's training, with study_config.json written)."""
    from hf_posenc.recipes.cli import main

    out = tmp_path / "study"
    assert main(["study", "--output-dir", str(out), "--train-length", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--train-length 16" in err[0] and "allowed: at least" in err[0]
    assert not out.exists() or not any(out.iterdir())
    # the experiment switched off, the same length is not refused for it
    assert (
        main(
            [
                "study",
                "--output-dir",
                str(out),
                "--train-length",
                "16",
                "--retrieval-documents",
                "0",
                "--dry-run",
            ]
        )
        == 0
    )


def test_the_early_bound_never_refuses_a_length_some_tokenizer_fits():
    """The early refusal is a lower bound: a byte-level BPE tokenizer trained on the prompt itself
    (every merge it could use) writes the prompt in as many tokens as GPT-2's pre-tokenizer
    gives pieces, and the exact check with that tokenizer accepts the smallest length the early
    check lets through; one token less is refused by both."""
    from tokenizers import pre_tokenizers

    from hf_posenc.recipes.study.retrieval import check_training_length, check_training_length_early
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    config = StudyConfig(train_length=256)
    prompt = _shortest_passkey_prompt(config)
    pieces = len(pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(prompt))
    best = train_bpe_tokenizer([prompt * 50], vocab_size=2048, min_frequency=1)
    assert len(best(prompt, add_special_tokens=False)["input_ids"]) == pieces
    lengths = sorted({pieces + 6, pieces + 9, pieces + 12})
    for length in lengths:
        short = StudyConfig(train_length=length)
        assert _shortest_passkey_prompt(short) == prompt  # the prompt with no haystack is length-free
        try:
            check_training_length_early(short)
            early = True
        except InvalidParameterError:
            early = False
        try:
            check_training_length(short, best)
            exact = True
        except InvalidParameterError:
            exact = False
        assert early == exact, (length, early, exact)
