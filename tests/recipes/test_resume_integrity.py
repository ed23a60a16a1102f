"""Every file a resume trusts is verified (issue 19 finding 3): the token cache
(``data-cache/tokens-*.arrow``: a flipped token id that stays inside the vocabulary, one past
it, a truncated file) and ``trainer_state.json`` (its own checksum, its step against the
checkpoint folder's, its losses) — a damaged one is named with what to do, and a resume never
trains on other tokens or restarts from the wrong step. Nor on a data file edited since the run
started: checkpoints record the token stream's fingerprint and a resume checks it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from training_runs import Interrupt, interrupt_at, run_config, save_base_model

from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.data import DataError, stdlib_documents
from hf_posenc.recipes.training import TrainConfig, train
from hf_posenc.recipes.training.checkpoints import STATE_FILE

VOCAB = 400


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    documents = list(stdlib_documents())[:10]
    save_base_model(root, documents, vocab_size=VOCAB, max_positions=64)
    (root / "data.txt").write_text("\n\n".join(documents[:6]))
    return root


def settings(workspace: Path, name: str) -> TrainConfig:
    return run_config(
        workspace,
        name,
        data=[str(workspace / "data.txt")],
        encoding="alibi",
        seq_len=32,
        batch_size=2,
        max_steps=6,
        save_every=2,
    )


def interrupted(workspace: Path, name: str) -> Path:
    """A run stopped at step 5: checkpoints 2 and 4, its token cache in ``name/data-cache``."""
    with pytest.raises(Interrupt):
        train(settings(workspace, name), callbacks=[interrupt_at(5)], progress=False)
    return workspace / name


def token_cache(run: Path) -> Path:
    (cache,) = (run / "data-cache").glob("tokens-*.arrow")
    return cache


def replace_a_token(path: Path, new: int) -> None:
    """Overwrite one int32 token id in the middle of the Arrow file's values with ``new``."""
    data = bytearray(path.read_bytes())
    for offset in range(len(data) // 2 & ~3, len(data) - 4, 4):
        value = struct.unpack_from("<i", data, offset)[0]
        if 10 < value < VOCAB - 10 and value != new:
            struct.pack_into("<i", data, offset, new)
            path.write_bytes(bytes(data))
            return
    raise AssertionError("no token id found to replace")


@pytest.mark.slow  # a run and a resume per case
@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda p: replace_a_token(p, 7), "does not match the SHA-256"),  # inside the vocabulary
        (lambda p: replace_a_token(p, 10**6), "does not match the SHA-256"),  # past it
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
    ],
    ids=["in-vocabulary", "past-vocabulary", "truncated"],
)
def test_a_damaged_token_cache_is_named_with_the_fix_before_a_resume_reads_it(workspace, damage, what):
    run = interrupted(workspace, f"cache-{what[:5]}-{id(damage)}")
    cache = token_cache(run)
    damage(cache)
    with pytest.raises(DataError) as caught:
        train(settings(workspace, run.name), resume=True, progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{cache}: the token cache") and what in message, (
        message
    )
    assert f"rm {cache}" in message  # what to do
    assert not (run / "final").exists()


@pytest.mark.slow  # a run and a resume per case
@pytest.mark.parametrize(
    "edit, problem",
    [
        # an edit that also drops the state's checksum (as an older checkpoint has none): the
        # step is still checked against the folder's
        (
            lambda state: state.update(step=2) or state.pop("state_sha256"),
            "records step 2 in the folder of step 4",
        ),
        (lambda state: state.update(step=2), "does not match its recorded SHA-256"),
        (lambda state: state["losses"][-1].__setitem__(1, 0.001), "does not match its recorded SHA-256"),
    ],
    ids=["edited-step-no-checksum", "edited-step", "edited-loss"],
)
def test_an_edited_trainer_state_is_named_and_the_previous_checkpoint_resumes(
    workspace, capsys, edit, problem
):
    run = interrupted(workspace, f"state-{len(problem)}-{id(edit)}")
    path = run / "checkpoint-4" / STATE_FILE
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    capsys.readouterr()
    resumed = train(settings(workspace, run.name), resume=True, progress=False)
    out = capsys.readouterr().out
    assert f"skipping damaged checkpoint {run / 'checkpoint-4'}: {path} {problem}" in out, out
    assert "checkpoint-2 (step 2)" in out
    final_losses = json.loads((resumed.final_dir / "losses.json").read_text())
    assert [step for step, _ in final_losses] == [1, 2, 3, 4, 5, 6]
    assert 0.001 not in [loss for _, loss in final_losses]


def test_the_trainer_state_records_a_checksum_of_itself(workspace):
    import hashlib

    run = interrupted(workspace, "state-sum")
    state = json.loads((run / "checkpoint-2" / STATE_FILE).read_text())
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    assert state["state_sha256"] == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (manifest,) = (run / "data-cache").glob("tokens-*.sha256.json")
    recorded = json.loads(manifest.read_text())["files"]
    cache = token_cache(run)
    assert recorded == {
        cache.name: {"bytes": cache.stat().st_size, "sha256": hashlib.sha256(cache.read_bytes()).hexdigest()}
    }


def expected_fingerprint(workspace: Path, data: Path) -> dict:
    """The token stream's fingerprint written from its definition: every document's ids with
    eos after it, as little-endian int32, and the document lengths as int64, each hashed, the
    two digests hashed together."""
    import hashlib

    import numpy as np
    from transformers import AutoTokenizer

    from hf_posenc.recipes.data import read_documents

    tokenizer = AutoTokenizer.from_pretrained(workspace / "base")
    documents = [
        tokenizer(text, add_special_tokens=False)["input_ids"] for text in read_documents([str(data)])
    ]
    documents = [[*ids, tokenizer.eos_token_id] for ids in documents]
    ids = np.array([t for doc in documents for t in doc], dtype="<i4").tobytes()
    lengths = np.array([len(doc) for doc in documents], dtype="<i8").tobytes()
    digest = hashlib.sha256(hashlib.sha256(ids).digest() + hashlib.sha256(lengths).digest()).hexdigest()
    return {"tokens": sum(map(len, documents)), "documents": len(documents), "sha256": digest}


def test_checkpoints_and_the_final_model_record_what_the_run_trained_on(workspace, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text((workspace / "data.txt").read_text())
    config = settings(workspace, "fingerprint")
    config.data = [str(data)]
    result = train(config, progress=False)
    expected = expected_fingerprint(workspace, data)
    assert (
        json.loads((workspace / "fingerprint" / "checkpoint-4" / STATE_FILE).read_text())["data"] == expected
    )
    assert json.loads((result.final_dir / "training_run.json").read_text())["training_data"] == expected


@pytest.mark.slow  # runs and resumes
@pytest.mark.parametrize(
    "change",
    [
        lambda text: text + "\n\none more document appended after the run started",
        lambda text: text.replace("def ", "fed ", 1),  # one word, the same number of documents
    ],
    ids=["appended", "one-word"],
)
def test_a_resume_on_edited_data_is_refused_and_the_same_data_resumes_exactly(workspace, tmp_path, change):
    """A data file edited after the run started: the settings name the same file, the tokens
    differ, so the resume is refused in one line (before, it went on training on the new tokens,
    its records naming the old file). The same text with a new mtime (the cache re-tokenised)
    resumes and ends exactly as the uninterrupted run."""
    original = (workspace / "data.txt").read_text()
    data = tmp_path / "data.txt"
    data.write_text(original)
    name = f"edited-{tmp_path.name}"
    config = settings(workspace, name)
    config.data = [str(data)]
    with pytest.raises(Interrupt):
        train(config, callbacks=[interrupt_at(5)], progress=False)
    data.write_text(change(original))
    with pytest.raises(InvalidParameterError) as caught:
        train(config, resume=True, progress=False)
    message = str(caught.value)
    assert "\n" not in message and "the training data is not what" in message and "checkpoint-4" in message
    assert "--overwrite" in message and not (workspace / name / "final").exists()

    data.write_text(original)  # the same tokens again, a new mtime: re-tokenised, resumed
    resumed = train(config, resume=True, progress=False)
    reference = settings(workspace, f"{name}-whole")
    reference.data = [str(data)]
    whole = train(reference, progress=False)
    assert json.loads((resumed.final_dir / "losses.json").read_text()) == json.loads(
        (whole.final_dir / "losses.json").read_text()
    )
