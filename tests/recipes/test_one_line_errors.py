"""Bad input and a full disk end in one line naming the value (or path) and what to do, before
a model loads where the input is at fault, with nothing half-written (issue 19 finding 7):
an empty data file, ``--lora-dropout 2``, ``--lora-targets bogus_proj``, ``--model nodir``
(no minute of hub retries), and no space left while saving a checkpoint or the final model."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
import torch
from training_runs import base_workspace, one_error

from hf_posenc.recipes import preflight
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import DataError
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training import TrainConfig, train
from hf_posenc.recipes.training.corpus import document_dataset
from hf_posenc.recipes.training.space import DiskFullError


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return base_workspace(tmp_path_factory.mktemp("one-line"))


def run(workspace: Path, tmp_path: Path, *extra: str) -> int:
    argv = ["train", "--model", str(workspace / "base"), "--output-dir", str(tmp_path / "run")]
    argv += ["--seq-len", "32", "--batch-size", "2", "--max-steps", "1"]
    return main([*argv, *extra])


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_empty_data_file_is_named(workspace, tmp_path, capsys, content, suffix):
    data = tmp_path / f"empty{suffix}"
    data.write_text(content)
    assert run(workspace, tmp_path, "--data", str(data)) == 2
    line = one_error(capsys)
    assert str(data) in line and "holds no document" in line, line
    assert not (tmp_path / "run" / "final").exists()


def test_a_folder_of_empty_files_says_so_and_a_folder_of_files_reads(tmp_path):
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"hold no non-empty document"):
        document_dataset(
            [str(tmp_path / "blank")], text_field="text", split="train", limit=None, cache_dir=tmp_path / "c"
        )
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.txt").write_text("first document")
    (tmp_path / "two" / "b.txt").write_text("second document")
    documents = document_dataset(
        [str(tmp_path / "two")], text_field="text", split="train", limit=None, cache_dir=tmp_path / "c"
    )
    assert list(documents["text"]) == ["first document", "second document"]


def test_lora_dropout_outside_a_probability_is_refused_before_anything(workspace, tmp_path, capsys):
    assert (
        run(workspace, tmp_path, "--data", str(workspace / "data.txt"), "--lora", "--lora-dropout", "2") == 2
    )
    line = one_error(capsys)
    assert "lora_dropout=2.0" in line and "[0, 1)" in line, line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # LoRA's output is scaled by alpha / r: at 0 the adapters add nothing and the run learns nothing
        (["--lora", "--lora-alpha", "0"], "lora_alpha=0 is not allowed; allowed: an integer >= 1"),
        # no document was read, and the error then said the data held none
        (["--max-documents", "0"], "max_documents=0 is not allowed; allowed: an integer >= 1"),
    ],
)
def test_settings_that_would_train_on_nothing_are_refused_before_anything(
    workspace, tmp_path, capsys, extra, message
):
    assert run(workspace, tmp_path, "--data", str(workspace / "data.txt"), *extra) == 2
    line = one_error(capsys)
    assert message in line, line
    assert not (tmp_path / "run").exists()


def test_an_encoding_rate_for_an_encoding_that_learns_nothing_is_refused_before_loading(
    workspace, tmp_path, capsys
):
    """``--encoding-lr`` with ALiBi (no parameters) is one line before the weights load (the
    encoding's parts built on the meta device say it learns nothing), for a fresh patch and for a
    checkpoint saved patched; with T5 (a learned table) the same flags pass the dry run."""
    data = str(workspace / "data.txt")
    assert run(workspace, tmp_path, "--data", data, "--encoding", "alibi", "--encoding-lr", "0.01") == 2
    line = one_error(capsys)
    assert "encoding_lr=0.01 would be ignored" in line and "drop --encoding-lr" in line, line
    assert not (tmp_path / "run").exists()

    import hf_posenc
    from hf_posenc.core.loading import load_model

    patched = hf_posenc.patch_model(load_model(str(workspace / "base")), "alibi")
    patched.save_pretrained(tmp_path / "alibi")
    argv = ["train", "--model", str(tmp_path / "alibi"), "--tokenizer", str(workspace / "base")]
    argv += ["--output-dir", str(tmp_path / "run"), "--data", data, "--encoding-lr", "0.01"]
    capsys.readouterr()
    assert main(argv) == 2
    assert "encoding_lr=0.01 would be ignored" in one_error(capsys)

    dry = ["--data", data, "--encoding", "t5", "--encoding-lr", "0.01", "--dry-run"]
    assert run(workspace, tmp_path, *dry) == 0


def test_unknown_lora_targets_are_named_with_the_models_modules_before_loading(workspace, tmp_path, capsys):
    data = str(workspace / "data.txt")
    assert run(workspace, tmp_path, "--data", data, "--lora", "--lora-targets", "q_proj", "bogus_proj") == 2
    line = one_error(capsys)
    assert "'bogus_proj'" in line and "'q_proj'" not in line and "q_proj" in line and "down_proj" in line, (
        line
    )
    assert not (tmp_path / "run" / "final").exists()


def test_lora_targets_without_lora_are_not_ignored(workspace, tmp_path, capsys):
    assert run(workspace, tmp_path, "--data", str(workspace / "data.txt"), "--lora-targets", "q_proj") == 2
    line = one_error(capsys)
    assert "lora_targets=['q_proj'] without lora would be ignored" in line, line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--lora-r", "4"],
            "--lora-r without --lora would be ignored; allowed: add --lora, or drop --lora-r",
        ),
        (["--lora-alpha", "8", "--lora-dropout", "0.1"], "--lora-alpha, --lora-dropout without --lora"),
        (
            ["--eval-tokens", "64"],
            "--eval-tokens without --eval-every would be ignored; allowed: add --eval-every N",
        ),
        (["--eval-data", "{data}", "--eval-split", "test"], "--eval-data, --eval-split without --eval-every"),
    ],
)
def test_flags_that_act_only_with_another_are_not_ignored(workspace, tmp_path, capsys, extra, message):
    data = str(workspace / "data.txt")
    extra = [data if value == "{data}" else value for value in extra]
    assert run(workspace, tmp_path, "--data", data, *extra) == 2
    line = one_error(capsys)
    assert message in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--split", "test"], "--split would be ignored: the data sources"),
        (["--text-field", "body"], "--text-field would be ignored: the data sources"),
        (["--eval-every", "2", "--eval-split", "test"], "--eval-split would be ignored"),
    ],
)
def test_a_split_or_field_no_source_has_is_refused(workspace, tmp_path, capsys, extra, message):
    """A local text file is read whole: `--split test` on it trained (or evaluated) on all of it,
    and `--text-field body` read it as one document, both silently."""
    assert run(workspace, tmp_path, "--data", str(workspace / "data.txt"), *extra) == 2
    line = one_error(capsys)
    assert message in line and "allowed:" in line, line
    assert not (tmp_path / "run").exists()


def test_which_sources_have_splits_and_fields(tmp_path):
    """Splits: hub datasets and builtin:stdlib; fields: hub datasets and local JSON files (a
    mixed list passes when any source reads the option)."""
    from hf_posenc import InvalidParameterError
    from hf_posenc.recipes.data import check_source_options

    text, rows = tmp_path / "a.txt", tmp_path / "rows.jsonl"
    text.write_text("one document")
    rows.write_text('{"body": "a row"}\n')
    check_source_options(["builtin:stdlib"], split_flag="--split")
    check_source_options(["hf:org/corpus", str(text)], split_flag="--split", text_field_flag="--text-field")
    check_source_options([str(text), str(rows)], text_field_flag="--text-field")
    check_source_options([str(text)])  # nothing given: nothing to check
    with pytest.raises(InvalidParameterError, match="--split would be ignored"):
        check_source_options([str(text), str(rows)], split_flag="--split")
    with pytest.raises(InvalidParameterError, match="--text-field would be ignored"):
        check_source_options([str(text)], text_field_flag="--text-field")
    with pytest.raises(InvalidParameterError, match="--text-field would be ignored"):  # stdlib has no fields
        check_source_options(["builtin:stdlib"], text_field_flag="--text-field")


def test_a_dry_runs_settings_file_holding_every_field_is_still_accepted(workspace, tmp_path, capsys):
    """The dependent-flag check reads the command line only: a --config file written from a dry
    run's resolved settings holds lora_r, eval_tokens and the rest at their defaults."""
    data = str(workspace / "data.txt")
    assert run(workspace, tmp_path, "--data", data, "--dry-run") == 0
    settings = tmp_path / "settings.json"
    settings.write_text(capsys.readouterr().out)
    assert main(["train", "--config", str(settings), "--dry-run"]) == 0


def test_unknown_lora_targets_are_refused_through_the_api_too(workspace, tmp_path):
    from hf_posenc import InvalidParameterError

    config = TrainConfig(
        model=str(workspace / "base"),
        output_dir=str(tmp_path / "run"),
        data=[str(workspace / "data.txt")],
        seq_len=32,
        batch_size=2,
        max_steps=1,
        lora=True,
        lora_targets=["c_attn"],
    )
    model = tiny_model("llama", vocab_size=400, max_positions=64)
    with pytest.raises(InvalidParameterError, match=r"--lora-targets 'c_attn' match no module"):
        train(config, model=model, progress=False)


@pytest.mark.parametrize("how", ["offline", "unreachable", "invalid"])
def test_a_model_that_is_neither_a_folder_nor_a_hub_id_to_be_had_is_refused_at_once(
    workspace, tmp_path, capsys, monkeypatch, how
):
    from huggingface_hub import constants

    name = "a/b c" if how == "invalid" else "nodir"
    if how == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(preflight, "_hub_unreachable", lambda endpoint: "test: no network")
    started = time.monotonic()
    argv = [
        "train",
        "--model",
        name,
        "--output-dir",
        str(tmp_path / "run"),
        "--data",
        str(workspace / "data.txt"),
    ]
    assert main(argv) == 2
    assert time.monotonic() - started < 5
    line = one_error(capsys)
    assert f"--model {name!r}" in line and "allowed:" in line, line
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_that_is_no_folder_nor_a_hub_id_to_be_had_is_refused_at_once(
    workspace, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(preflight, "_hub_unreachable", lambda endpoint: "test: no network")
    argv = ["train", "--model", str(workspace / "base"), "--tokenizer", "nodir"]
    assert main([*argv, "--output-dir", str(tmp_path / "run"), "--data", str(workspace / "data.txt")]) == 2
    line = one_error(capsys)
    assert "--tokenizer 'nodir'" in line and "tokenizer_config.json" in line, line


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "/full/disk/file")


def test_no_space_while_saving_a_checkpoint_is_one_line_and_leaves_nothing(
    workspace, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(torch, "save", no_space)  # accelerate saves the optimizer with torch.save
    data = str(workspace / "data.txt")
    assert run(workspace, tmp_path, "--data", data, "--save-every", "1", "--max-steps", "2") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "no space left on /full/disk/file while saving checkpoint 1" in line, line
    assert not list((tmp_path / "run").glob("checkpoint-*")), list((tmp_path / "run").iterdir())
    assert not (tmp_path / "run" / "final").exists()


def test_no_space_while_saving_the_final_model_is_one_line_and_leaves_nothing(
    workspace, tmp_path, monkeypatch
):
    from transformers import PreTrainedModel

    def partial_then_full(self, folder, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos: file write failed")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", partial_then_full)
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 0})())
    config = TrainConfig(
        model=str(workspace / "base"),
        output_dir=str(tmp_path / "run"),
        data=[str(workspace / "data.txt")],
        seq_len=32,
        batch_size=2,
        max_steps=1,
        save_every=0,
    )
    with pytest.raises(DiskFullError) as caught:
        train(config, progress=False)
    assert str(caught.value).startswith(
        f"no space left on {tmp_path / 'run' / 'final.tmp'} while saving the final model"
    )
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run" / "final.tmp").exists() and not (tmp_path / "run" / "final").exists()
