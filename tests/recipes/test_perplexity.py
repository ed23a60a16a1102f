"""Length-extrapolation evaluation: ``evaluate_lengths``, the report files and ``hf-posenc perplexity``.

Losses are checked against independent references: a hand-written loop of
``F.cross_entropy`` over each window's full-model logits, and a constructed model whose
per-position loss is known in closed form.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import hf_posenc
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.cli.perplexity import parse_encoding_params
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.evaluation import (
    EvaluationError,
    LengthResult,
    check_output_dir,
    evaluate_lengths,
    format_table,
    write_report,
)
from hf_posenc.recipes.evaluation import perplexity as perplexity_module
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def manual_loss(model: nn.Module, tokens: torch.Tensor, length: int, budget: int) -> tuple[float, int]:
    """Reference: full-model logits of the windows tokens[0:L], tokens[L:2L], ... below ``budget``;
    summed token cross-entropy (float64) / number of predicted tokens."""
    windows = tokens[: budget // length * length].view(-1, length)
    with torch.no_grad():
        logits = model(windows).logits  # (W, L, V)
    nll = F.cross_entropy(logits[:, :-1].double().flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")
    count = windows.shape[0] * (length - 1)
    return nll.item() / count, count


def manual_stderr(model: nn.Module, tokens: torch.Tensor, length: int, budget: int) -> float:
    """Reference: each window's mean token loss, then the standard error of their mean
    (statistics.stdev / sqrt(n), the textbook formula)."""
    import statistics

    windows = tokens[: budget // length * length].view(-1, length)
    with torch.no_grad():
        logits = model(windows).logits  # (W, L, V)
    per_token = F.cross_entropy(logits[:, :-1].double().transpose(1, 2), windows[:, 1:], reduction="none")
    means = per_token.mean(dim=1).tolist()  # (W,)
    return statistics.stdev(means) / math.sqrt(len(means))


class RecordingModel(nn.Module):
    """Uniform logits (loss = log V exactly); records every batch of windows it is given."""

    def __init__(self, vocab: int = 128) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.zeros(()))
        self.batches: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, **kwargs) -> types.SimpleNamespace:
        self.batches.append(input_ids.clone())
        return types.SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


class PositionLimitedCounter(nn.Module):
    """On the stream 0, 1, 2, ... (mod V) it predicts the next token with logit ``margin`` at
    window positions below ``limit`` and knows nothing (uniform) from ``limit`` on: the shape
    of a model that does not extrapolate past its training length."""

    def __init__(self, vocab: int, limit: int, margin: float) -> None:
        super().__init__()
        self.vocab, self.limit, self.margin = vocab, limit, margin
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor, **kwargs) -> types.SimpleNamespace:
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab)
        known = torch.arange(length) < self.limit  # (L,)
        hit = F.one_hot((input_ids + 1) % self.vocab, self.vocab).float() * self.margin
        return types.SimpleNamespace(logits=logits + hit * known[None, :, None])


# -- evaluate_lengths ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,encoding", [("llama", None), ("gpt2", "alibi"), ("mistral", "expe")])
def test_loss_equals_manual_cross_entropy_of_each_window(family, encoding, monkeypatch):
    """Loss at each length = sum of per-token cross-entropy of the full model's logits on every
    window / number of predicted tokens; the budget is the 192 leading tokens (3 x 64) for all lengths.
    (evaluate_lengths runs the LM head in small chunks here, the reference in one piece.)"""
    monkeypatch.setattr(perplexity_module, "CHUNK_ELEMENTS", 101 * 7)  # the head runs in 7-token chunks
    model = tiny_model(family, vocab_size=101, max_positions=64, seed=3)
    if encoding:
        hf_posenc.patch_model(model, encoding)
    tokens = torch.randint(0, 101, (200,), generator=torch.Generator().manual_seed(0))
    head_calls: list = []
    model.get_output_embeddings().register_forward_hook(lambda *args: head_calls.append(1))
    results = evaluate_lengths(model, tokens, 16, multiples=(1, 2, 4), batch_size=2, progress=False)
    assert [(r.multiple, r.length, r.windows) for r in results] == [(1, 16, 12), (2, 32, 6), (4, 64, 3)]
    # per batch ceil(predicted / 7) chunks: 6 x ceil(30/7) + 3 x ceil(62/7) + ceil(126/7) + ceil(63/7)
    assert len(head_calls) == 6 * 5 + 3 * 9 + 18 + 9
    for r in results:
        expected, count = manual_loss(model, tokens, r.length, 192)
        assert r.tokens == count
        assert r.loss == pytest.approx(expected, rel=1e-5)
        assert r.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
        assert r.stderr == pytest.approx(manual_stderr(model, tokens, r.length, 192), rel=1e-4)


def test_windows_are_disjoint_and_every_length_reads_the_same_tokens():
    """Concatenating the windows a model sees at one length gives exactly the first 96 tokens of
    the stream, in order (no overlap, no gap), at every length; batches hold batch_size windows."""
    model = RecordingModel()
    tokens = torch.arange(100)
    results = evaluate_lengths(model, tokens, 8, multiples=(1, 2, 4), batch_size=3, progress=False)
    lengths = [8, 16, 32]
    seen = {length: [b for b in model.batches if b.shape[1] == length] for length in lengths}
    for length, result in zip(lengths, results, strict=True):
        assert torch.equal(torch.cat(seen[length]).reshape(-1), torch.arange(96))
        assert [b.shape[0] for b in seen[length]][:-1] == [3] * (len(seen[length]) - 1)
        assert result.windows == 96 // length and result.tokens == (96 // length) * (length - 1)
        assert result.loss == pytest.approx(math.log(128), rel=1e-6)  # uniform over 128 classes


class RandomLogitsModel(nn.Module):
    """Fixed pseudo-random logits per (position, token id): a loss whose float rounding shows."""

    def __init__(self, vocab: int = 97) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * 3)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.table[input_ids])


def test_published_loss_is_reduced_as_every_earlier_report_reduced_it():
    """Results stay identical to the digit across versions: the loss is cross_entropy's own fp32
    sum over each batch, accumulated batch by batch in float64, over the predicted tokens (the
    reduction every earlier report used); exact equality, not a tolerance."""
    model = RandomLogitsModel()
    tokens = torch.randint(0, 97, (400,), generator=torch.Generator().manual_seed(1))
    results = evaluate_lengths(model, tokens, 16, multiples=(1, 2), batch_size=3, progress=False)
    for result in results:
        windows = tokens[: result.windows * result.length].view(result.windows, result.length)
        expected = 0.0
        for start in range(0, result.windows, 3):
            batch = windows[start : start + 3]
            logits = model.table[batch[:, :-1]].reshape(-1, 97).float()
            expected += F.cross_entropy(logits, batch[:, 1:].reshape(-1), reduction="sum").double().item()
        assert result.loss == expected / result.tokens


def test_budget_with_max_tokens_and_lengths_that_do_not_divide_each_other():
    """max_tokens=70 with longest 32 -> 64 tokens; lengths 8 and 12 (lcm 24) fitting twice in
    50 tokens -> 48 each; lcm 48 not fitting in 40 tokens -> cut to whole windows of 16."""
    cases = [((8, (1, 2, 4), 100, 70), {8: 64, 16: 64, 32: 64}), ((4, (2, 3), 50, None), {8: 48, 12: 48})]
    cases.append(((4, (3, 4), 40, None), {12: 24, 16: 32}))
    for (train, multiples, available, max_tokens), read in cases:
        model = RecordingModel()
        evaluate_lengths(
            model, torch.arange(available), train, multiples, max_tokens=max_tokens, progress=False
        )
        for length, count in read.items():
            windows = torch.cat([b for b in model.batches if b.shape[1] == length]).reshape(-1)
            assert torch.equal(windows, torch.arange(count))


def test_known_shape_flat_until_the_training_length_then_rising():
    """A model that is right (logit margin m) only at positions < T: the mean NLL over a window
    of L tokens is (min(L-1, T) * a + max(0, L-1-T) * log V) / (L-1), a = log(1 + (V-1) e^-m);
    ev=1 is the lowest and the loss rises with every doubling."""
    vocab, train, margin = 16, 32, 6.0
    model = PositionLimitedCounter(vocab, train, margin)
    tokens = torch.arange(1024) % vocab
    results = evaluate_lengths(model, tokens, train, multiples=(1, 2, 4, 8), batch_size=4, progress=False)
    a = math.log(1 + (vocab - 1) * math.exp(-margin))
    for r in results:
        predicted = r.length - 1
        expected = (min(predicted, train) * a + max(0, predicted - train) * math.log(vocab)) / predicted
        assert r.loss == pytest.approx(expected, rel=1e-6)
    losses = [r.loss for r in results]
    assert losses == sorted(losses) and losses[0] == pytest.approx(a, rel=1e-6)


def test_model_training_flag_is_restored_and_no_gradients_are_kept():
    """evaluate_lengths runs in eval mode under no_grad and leaves a training model training."""
    model = tiny_model("llama", vocab_size=50, max_positions=32).train()
    modes = []
    model.model.register_forward_pre_hook(
        lambda module, args: modes.append((module.training, torch.is_grad_enabled()))
    )
    evaluate_lengths(model, torch.randint(0, 50, (40,)), 8, multiples=(1, 2), progress=False)
    assert modes and all(mode == (False, False) for mode in modes)
    assert model.training and all(p.grad is None for p in model.parameters())


# -- errors before any work ------------------------------------------------------------------
def _count_forwards(model: nn.Module) -> list:
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_stream_shorter_than_one_longest_window_says_how_many_tokens():
    model = RecordingModel()
    with pytest.raises(
        EvaluationError, match=r"has 50 tokens but one window of the longest evaluation length needs 64"
    ):
        evaluate_lengths(model, torch.arange(50), 16, multiples=(1, 4), progress=False)
    with pytest.raises(
        EvaluationError, match=r"max_tokens=40 is less than one window of the longest length 64"
    ):
        evaluate_lengths(model, torch.arange(500), 16, multiples=(1, 4), max_tokens=40, progress=False)
    assert model.batches == []


@pytest.mark.parametrize(
    "multiples,message",
    [
        ((), "multiples is empty"),
        ((1, 0), "multiple 0 is not allowed"),
        ((1, 2.5), "multiple 2.5"),
        ((2, 1, 2), r"repeat \[2\]"),
    ],
)
def test_bad_multiples_are_refused(multiples, message):
    with pytest.raises(EvaluationError, match=message):
        evaluate_lengths(RecordingModel(), torch.arange(100), 4, multiples=multiples, progress=False)


def test_bad_tokens_and_batch_size_are_refused():
    with pytest.raises(EvaluationError, match=r"1-D integer tensor.*\(2, 50\)"):
        evaluate_lengths(RecordingModel(), torch.zeros(2, 50, dtype=torch.long), 4, (1,), progress=False)
    with pytest.raises(EvaluationError, match="batch_size=0"):
        evaluate_lengths(RecordingModel(), torch.arange(50), 4, (1,), batch_size=0, progress=False)


def test_learned_table_shorter_than_the_longest_length_fails_before_work():
    """A learned table of 32 positions cannot take 64-token windows: PositionRangeError naming both."""
    model = hf_posenc.patch_model(
        tiny_model("llama", vocab_size=50, max_positions=128), "learned", max_positions=32
    )
    calls = _count_forwards(model)
    with pytest.raises(hf_posenc.PositionRangeError, match=r"evaluation length 64 .*max_positions=32"):
        evaluate_lengths(model, torch.randint(0, 50, (200,)), 16, multiples=(1, 2, 4), progress=False)
    assert calls == []


def test_native_gpt2_longer_than_n_positions_fails_before_work_but_patched_gpt2_runs():
    model = tiny_model("gpt2", vocab_size=50, max_positions=32)
    calls = _count_forwards(model)
    tokens = torch.randint(0, 50, (200,))
    with pytest.raises(hf_posenc.PositionRangeError, match=r"evaluation length 64 .*n_positions=32"):
        evaluate_lengths(model, tokens, 16, multiples=(1, 4), progress=False)
    assert calls == []
    hf_posenc.patch_model(model, "alibi")  # relative encoding: no length limit
    assert len(evaluate_lengths(model, tokens, 16, multiples=(1, 4), progress=False)) == 2


# -- report ----------------------------------------------------------------------------------
def _result(multiple: int, loss: float, stderr: float = 0.0625) -> LengthResult:
    return LengthResult(multiple, 8 * multiple, 2, 2 * (8 * multiple - 1), loss, math.exp(loss), stderr)


REPORT = {
    "rope": [_result(1, 2.5), _result(2, 3.75)],
    "expe": [_result(1, 2.25), _result(2, 2.125), _result(4, 2.0)],
}


def test_table_has_a_row_per_model_a_loss_column_per_multiple_with_units_errors_and_counts():
    """Each cell is loss ± standard error (n=windows), the header names nats and the length; the
    increase from the shortest to the longest length ranks the rows (lower first); a note says what
    the numbers are and any warning follows."""
    table = format_table(REPORT, perplexity=True, warnings=["look out"]).splitlines()
    header = " ".join(table[0].split())
    for m, length in ((1, 8), (2, 16), (4, 32)):
        assert f"loss, nats (ev={m}, {length} tok)" in header and f"perplexity (ev={m})" in header
    assert "increase, nats" in header and "rank" in header
    rope, expe = table[2], table[3]
    assert rope.startswith("rope") and "2.500 ± 0.062 (n=2)" in rope and "3.750 ± 0.062 (n=2)" in rope
    assert expe.startswith("expe") and "2.000 ± 0.062 (n=2)" in expe and f"{math.exp(2.25):.2f}" in expe
    # rope rises 3.75 - 2.5 = +1.25 (rank 2), expe 2.0 - 2.25 = -0.25 (rank 1); SE sqrt(2) * 0.0625
    assert f"+1.250 ± {math.sqrt(2) * 0.0625:.3f}" in rope and rope.split()[-4] == "2"
    assert "-0.250" in expe and expe.split()[-4] == "1"
    assert "nats" in table[-2] and "lower is better" in table[-2]
    assert table[-1] == "warning: look out"


def test_write_report_writes_csv_json_and_a_png(tmp_path):
    import matplotlib.image

    paths = write_report(REPORT, tmp_path / "out", train_length=8, title="demo", metadata={"data": ["x"]})
    lines = paths["csv"].read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert any(line.startswith("# date: ") for line in comments)
    assert any(line.startswith("# versions: ") and "torch" in line for line in comments)
    assert any("too few windows" in line for line in comments)  # 2 windows per length
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [(r["label"], int(r["length_tokens"]), float(r["loss_nats"])) for r in rows] == [
        ("rope", 8, 2.5), ("rope", 16, 3.75), ("expe", 8, 2.25), ("expe", 16, 2.125), ("expe", 32, 2.0)
    ]  # fmt: skip
    assert {float(r["loss_stderr_nats"]) for r in rows} == {0.0625} and {r["windows"] for r in rows} == {"2"}
    document = json.loads(paths["json"].read_text())
    assert document["train_length_tokens"] == 8 and document["metadata"]["data"] == ["x"]
    assert document["metadata"]["provenance"]["date"] and "loss_nats" in document["units"]
    assert document["results"]["expe"][2] == {
        "multiple": 4, "length_tokens": 32, "windows": 2, "predicted_tokens": 62,
        "loss_nats": 2.0, "loss_stderr_nats": 0.0625, "perplexity": math.exp(2.0),
    }  # fmt: skip
    assert [row["label"] for row in document["ranking"]] == ["expe", "rope"]
    assert any("too few windows" in w for w in document["warnings"])
    assert paths["png"].read_bytes()[:8] == PNG_SIGNATURE
    assert matplotlib.image.imread(paths["png"]).shape[2] in (3, 4)
    assert "expe" in paths["table"].read_text()


def test_output_dir_that_is_a_file_or_under_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        check_output_dir(afile)
    with pytest.raises(NotADirectoryError, match="a parent path is a file"):
        check_output_dir(afile / "sub")
    assert check_output_dir(tmp_path / "new" / "dir").is_dir()


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="chmod cannot make a directory unwritable for root (CI runs as root); test_output_dir_where_files_cannot_be_created_is_refused covers the same path",
)
def test_unwritable_output_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="is not writable"):
        check_output_dir(locked)


def test_output_dir_where_files_cannot_be_created_is_refused(tmp_path, monkeypatch):
    """(Simulated, for root) a failing test write becomes a PermissionError naming the directory."""
    import hf_posenc.recipes.evaluation.report as report

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(PermissionError, match=r"'.*out' is not writable \(Permission denied\)"):
        check_output_dir(tmp_path / "out")


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
