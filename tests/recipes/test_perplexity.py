"""Length-extrapolation evaluation: ``evaluate_lengths`` and its refusals before any work (the
report: test_perplexity_report.py; the command line: test_perplexity_cli.py).

Losses are checked against independent references: a hand-written loop of
``F.cross_entropy`` over each window's full-model logits, and a constructed model whose
per-position loss is known in closed form.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from references.perplexity import manual_loss, manual_stderr
from torch import nn
from torch.nn import functional as F

import hf_posenc
from hf_posenc.recipes.evaluation import (
    EvaluationError,
    evaluate_lengths,
)
from hf_posenc.recipes.evaluation import perplexity as perplexity_module
from hf_posenc.recipes.tiny import tiny_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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
