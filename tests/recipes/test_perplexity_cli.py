"""``hf-posenc perplexity`` end to end on a tiny model and tokenizer trained here: the table and
report files, JSON encoding parameters, bad input refused in one line before any model loads,
evaluation-only overrides of a saved checkpoint (scaling, an extension encoding), a learned
table under interpolation.
"""

from __future__ import annotations

import csv
import itertools
import json
import re

import pytest
import torch
from references.perplexity import manual_loss

import hf_posenc
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.cli.perplexity import parse_encoding_params
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- the command line --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A BPE tokenizer, three saved tiny models with it, and .txt / .jsonl data files."""
    root = tmp_path_factory.mktemp("perplexity")
    texts = [doc[:4000] for doc in itertools.islice(stdlib_documents(), 4)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=320)
    models = {
        "llama": tiny_model("llama", vocab_size=len(tokenizer), max_positions=64, seed=1),
        "gpt2-alibi": hf_posenc.patch_model(
            tiny_model("gpt2", vocab_size=len(tokenizer), max_positions=32), "alibi"
        ),
        "gpt2": tiny_model("gpt2", vocab_size=len(tokenizer), max_positions=32),
        "learned32": hf_posenc.patch_model(
            tiny_model("llama", vocab_size=len(tokenizer)), "learned", max_positions=32
        ),
        "expe": hf_posenc.patch_model(
            tiny_model("llama", vocab_size=len(tokenizer), seed=2), "expe", theta=0.25
        ),
        "rope": hf_posenc.patch_model(tiny_model("llama", vocab_size=len(tokenizer), seed=3), "rope"),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "valid.txt").write_text(texts[0][:600])
    (root / "valid.jsonl").write_text("".join(json.dumps({"text": t[:600]}) + "\n" for t in texts[1:3]))
    (root / "tiny.txt").write_text("a few words only")
    return root, tokenizer


SCALING = 'scaling={{"type":"linear","factor":{}}}'


def run_cli(root, *extra: str) -> int:
    data = [str(root / "valid.txt"), str(root / "valid.jsonl")]
    argv = ["perplexity", "--data", *data, "--train-length", "16", "--batch-size", "8", "--no-progress"]
    return main([*argv, *extra])


def test_cli_end_to_end_table_csv_json_png_with_one_row_per_model(workspace, tmp_path, capsys):
    """Two models -> a two-row table, 2x3 CSV rows, JSON per label, a PNG; the llama numbers
    equal the manual window loop on the data tokenised by hand (txt document, then jsonl rows)."""
    root, tokenizer = workspace
    out = tmp_path / "report"
    models = [str(root / "llama"), str(root / "gpt2-alibi")]
    assert run_cli(root, "--model", *models, "--multiples", "1", "2", "4", "--output", str(out)) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("model ") :].splitlines()
    assert "loss, nats (ev=1, 16 tok)" in table[0] and "loss, nats (ev=4, 64 tok)" in table[0]
    assert table[2].startswith("llama (native)") and table[3].startswith("gpt2-alibi (alibi)")

    rows = list(csv.DictReader(line for line in (out / "results.csv").open() if not line.startswith("#")))
    assert [(r["label"], r["multiple"]) for r in rows] == [
        (label, m) for label in ("llama (native)", "gpt2-alibi (alibi)") for m in ("1", "2", "4")
    ]
    document = json.loads((out / "results.json").read_text())
    assert list(document["results"]) == ["llama (native)", "gpt2-alibi (alibi)"]
    assert (out / "loss_vs_length.png").read_bytes()[:8] == PNG_SIGNATURE
    record = document["metadata"]["provenance"]  # what produced these numbers
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["hf-posenc"]
    assert record["date"] and "perplexity" in record["command"]

    texts = [(root / "valid.txt").read_text()] + [
        json.loads(line)["text"] for line in (root / "valid.jsonl").read_text().splitlines()
    ]
    ids = [i for text in texts for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    tokens = torch.tensor(ids)
    budget = len(ids) // 64 * 64
    llama = hf_posenc.load_model(str(root / "llama")).eval()
    for row in rows[:3]:
        expected, count = manual_loss(llama, tokens, int(row["length_tokens"]), budget)
        assert int(row["predicted_tokens"]) == count
        assert float(row["loss_nats"]) == pytest.approx(expected, rel=1e-5)


def test_cli_encoding_params_are_json(workspace, tmp_path, capsys):
    """--encoding-param scaling='{"type":"linear","factor":2}' reaches the patched model."""
    root, _ = workspace
    assert parse_encoding_params(['scaling={"type":"linear","factor":2}', "theta=500", "name=abc"]) == {
        "scaling": {"type": "linear", "factor": 2}, "theta": 500, "name": "abc"
    }  # fmt: skip
    args = ["--model", str(root / "llama"), "--encoding", "rope", "--encoding-param"]
    args += ['scaling={"type":"linear","factor":2}', "--multiples", "1", "2", "--output", str(tmp_path)]
    assert run_cli(root, *args) == 0
    document = json.loads((tmp_path / "results.json").read_text())
    (label,) = document["results"]
    assert label.startswith("llama (rope") and document["metadata"]["models"][label]["encoding_params"] == {
        "scaling": {"type": "linear", "factor": 2}
    }


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing model", r"model directory '.*nowhere' does not exist"),
        ("missing data", r"data source '.*absent.jsonl' is not a file"),
        ("output is a file", r"output path '.*valid.txt' exists and is not a directory"),
        (
            "learned too short",
            r"evaluation length 64 is longer than the learned position table \(max_positions=32\)",
        ),
        ("learned param too short", r"evaluation length 64 .*max_positions=32"),
        ("native gpt2 too long", r"evaluation length 64 is longer than native GPT-2's n_positions=32"),
        (
            "too few tokens",
            r"the token stream has \d+ tokens but one window of the longest evaluation length needs 64",
        ),
        ("bad param", r"--encoding-param 'theta' is not allowed; allowed: KEY=VALUE"),
        ("unknown param", r"encoding 'rope' has no parameter 'thetta'"),
        ("labels", r"--labels gives 2 label\(s\) for 1 model\(s\)"),
        ("conflicting encoding", r"was saved with encoding 'alibi'; cannot evaluate it as 'rope'"),
        (
            "override unknown",
            r"overriding the saved encoding parameters: encoding 'expe' has no parameter 'thetta'",
        ),
        ("override bad factor", r"overriding the saved encoding parameters: .*factor"),
        ("override on plain", r"'.*llama' is a plain checkpoint .* add --encoding NAME"),
        (
            "override learned short",
            r"longer than the learned position table \(max_positions=32\) covers \(63",
        ),
    ],
)
def test_cli_bad_inputs_fail_with_a_clear_message_before_loading(
    workspace, tmp_path, capsys, monkeypatch, case, message
):
    root, _ = workspace
    loads = []
    monkeypatch.setattr(hf_posenc.core.loading, "load_model", lambda *a, **k: loads.append(a))
    out = ["--output", str(tmp_path / "out")]
    llama = ["--model", str(root / "llama")]
    argv = {
        "missing model": ["--model", str(root / "nowhere"), *out],
        "missing data": [*llama, *out, "--data", str(root / "absent.jsonl")],
        "output is a file": [*llama, "--output", str(root / "valid.txt")],
        "learned too short": ["--model", str(root / "learned32"), "--multiples", "1", "4", *out],
        "learned param too short": [*llama, "--encoding", "learned", "--encoding-param", "max_positions=32"]
        + ["--multiples", "4", *out],
        "native gpt2 too long": ["--model", str(root / "gpt2"), "--multiples", "1", "4", *out],
        "too few tokens": [*llama, "--data", str(root / "tiny.txt"), "--multiples", "4", *out],
        "bad param": [*llama, "--encoding", "rope", "--encoding-param", "theta", *out],
        "unknown param": [*llama, "--encoding", "rope", "--encoding-param", "thetta=2", *out],
        "labels": [*llama, "--labels", "a", "b", *out],
        "conflicting encoding": ["--model", str(root / "gpt2-alibi"), "--encoding", "rope", *out],
        "override unknown": ["--model", str(root / "expe"), "--encoding-param", "thetta=2", *out],
        "override bad factor": ["--model", str(root / "expe"), "--encoding-param", SCALING.format(-2), *out],
        "override on plain": [*llama, "--encoding-param", SCALING.format(2), *out],
        "override learned short": ["--model", str(root / "learned32"), "--encoding-param", SCALING.format(2)]
        + ["--multiples", "1", "4", *out],
    }[case]
    assert run_cli(root, *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-posenc perplexity: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert loads == []


@pytest.mark.slow  # multi-second; CI runs it
def test_cli_overrides_a_saved_checkpoints_scaling_for_the_evaluation_only(workspace, tmp_path, capsys):
    """--encoding-param on a saved patched checkpoint (no --encoding) evaluates it with the parameter
    changed (ExPE trained unscaled, evaluated at factor 2 = the paper's "scaled by 0.5"): the row is
    labelled as an evaluation-time change, its losses equal the manual window loop on the model
    reconfigured in Python, differ from the unscaled row, and the metadata records the override; the
    checkpoint on disk is unchanged."""
    root, tokenizer = workspace
    on_disk = json.loads((root / "expe" / "config.json").read_text())["posenc"]
    out = tmp_path / "report"
    argv = ["--model", str(root / "expe"), str(root / "expe"), "--multiples", "1", "2", "--output", str(out)]
    assert run_cli(root, *argv[:2], "--multiples", "1", "2", "--output", str(tmp_path / "plain")) == 0
    assert run_cli(root, "--model", str(root / "expe"), "--encoding-param", SCALING.format(2), *argv[3:]) == 0
    scaled = json.loads((out / "results.json").read_text())
    unscaled = json.loads((tmp_path / "plain" / "results.json").read_text())
    (label,) = scaled["results"]
    assert label == "expe (expe, x0.5 at eval)" and list(unscaled["results"]) == ["expe (expe)"]
    record = scaled["metadata"]["models"][label]
    assert record["eval_overrides"] == {"scaling": {"type": "linear", "factor": 2}}
    assert record["encoding_params"]["scaling"] == {"type": "linear", "factor": 2}
    model = hf_posenc.load_model(str(root / "expe")).eval()
    hf_posenc.reconfigure(model, scaling={"type": "linear", "factor": 2.0})
    texts = [(root / "valid.txt").read_text()]
    texts += [json.loads(line)["text"] for line in (root / "valid.jsonl").read_text().splitlines()]
    tokens = torch.tensor(
        [i for text in texts for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    )
    budget = len(tokens) // 32 * 32
    for row, unscaled_row in zip(scaled["results"][label], unscaled["results"]["expe (expe)"], strict=True):
        expected, count = manual_loss(model, tokens, row["length_tokens"], budget)
        assert row["predicted_tokens"] == count and row["loss_nats"] == pytest.approx(expected, abs=1e-6)
        # a random tiny model barely uses positions: the change is small but far above the tolerance
        assert abs(row["loss_nats"] - unscaled_row["loss_nats"]) > 1e-5
    assert json.loads((root / "expe" / "config.json").read_text())["posenc"] == on_disk


@pytest.mark.slow  # multi-second; CI runs it
def test_cli_evaluates_a_rope_run_with_selfextend_without_training(workspace, tmp_path):
    """--encoding selfextend on a checkpoint saved with rope (an evaluation-only switch: selfextend
    extends rope): the row says so, its losses equal the manual window loop on the same weights
    patched with selfextend from the start, and the checkpoint on disk is unchanged."""
    root, tokenizer = workspace
    on_disk = json.loads((root / "rope" / "config.json").read_text())["posenc"]
    out = tmp_path / "report"
    params = ["--encoding-param", "window=4", "--encoding-param", "group_size=2"]
    argv = ["--model", str(root / "rope"), "--encoding", "selfextend", *params, "--multiples", "1", "2"]
    assert run_cli(root, *argv, "--output", str(out)) == 0
    report = json.loads((out / "results.json").read_text())
    (label,) = report["results"]
    assert label == "rope (selfextend, group_size=2, window=4 at eval)"
    model = hf_posenc.from_pretrained(str(root / "rope")).eval()
    hf_posenc.unpatch_model(model)
    hf_posenc.patch_model(model, "selfextend", window=4, group_size=2)
    texts = [(root / "valid.txt").read_text()]
    texts += [json.loads(line)["text"] for line in (root / "valid.jsonl").read_text().splitlines()]
    tokens = torch.tensor(
        [i for text in texts for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    )
    budget = len(tokens) // 32 * 32
    for row in report["results"][label]:
        expected, count = manual_loss(model, tokens, row["length_tokens"], budget)
        assert row["predicted_tokens"] == count and row["loss_nats"] == pytest.approx(expected, abs=1e-6)
    assert json.loads((root / "rope" / "config.json").read_text())["posenc"] == on_disk


@pytest.mark.slow  # multi-second; CI runs it
def test_cli_learned_table_reaches_factor_times_its_rows_under_interpolation(workspace, tmp_path):
    """A learned table of 32 rows covers positions 0..31; interpolated by 4 it covers 4 * 31 + 1 = 125
    positions, so a 64-token evaluation that is refused unscaled runs."""
    root, _ = workspace
    argv = [
        "--model",
        str(root / "learned32"),
        "--encoding-param",
        SCALING.format(4),
        "--multiples",
        "1",
        "4",
    ]
    assert run_cli(root, *argv, "--output", str(tmp_path)) == 0
    (label,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert label == "learned32 (learned, x0.25 at eval)"
