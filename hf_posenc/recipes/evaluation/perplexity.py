"""Loss and perplexity at several multiples of the training length (length extrapolation).

``evaluate_lengths(model, tokens, train_length)`` cuts the token stream into
non-overlapping windows of ``L = multiple * train_length`` tokens for each multiple and
reports the mean next-token negative log-likelihood over every predicted token (``L - 1``
per window: each window is an independent sequence starting at position 0). This is the
"Loss (ev=k)" of Datseris et al. 2025, Tables 1-3 (evaluation at ``k`` times the training
length).

Every length reads the same tokens — the first ``token_budget`` tokens of the stream — so
the numbers are comparable across lengths: a longer window sees more context, never other
text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ...core.limits import position_limit
from ...errors import PositionRangeError
from .errors import EvaluationError

#: fp32 logit elements per chunk (~256 MiB)
CHUNK_ELEMENTS = 1 << 26


@dataclasses.dataclass(frozen=True)
class LengthResult:
    """Loss at one evaluation length ``length = multiple * train_length``.

    ``tokens`` is the number of predicted tokens (``windows * (length - 1)``); ``loss`` is
    their mean negative log-likelihood in nats; ``perplexity`` is ``exp(loss)``; ``stderr`` is
    the standard error of ``loss`` over the windows, ``s / sqrt(windows)`` with ``s`` the sample
    standard deviation of the windows' mean losses (every window predicts the same number of
    tokens, so ``loss`` is their plain mean); NaN for a single window.
    """

    multiple: int
    length: int
    windows: int
    tokens: int
    loss: float
    perplexity: float
    stderr: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_record(self) -> dict[str, Any]:
        """The row as results files write it: every key names its unit."""
        return {
            "multiple": self.multiple,
            "length_tokens": self.length,
            "windows": self.windows,
            "predicted_tokens": self.tokens,
            "loss_nats": self.loss,
            "loss_stderr_nats": self.stderr,
            "perplexity": self.perplexity,
        }


def standard_error(window_losses: Sequence[float]) -> float:
    """Standard error of the mean of ``window_losses``: sample standard deviation / sqrt(n); NaN for n < 2."""
    n = len(window_losses)
    if n < 2:
        return math.nan
    mean = math.fsum(window_losses) / n
    variance = math.fsum((x - mean) ** 2 for x in window_losses) / (n - 1)
    return math.sqrt(variance / n)


def check_multiples(multiples: Sequence[int], train_length: int) -> list[int]:
    """Validate ``train_length`` and ``multiples``; return the multiples as a list of ints."""
    if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < 1:
        raise EvaluationError(f"train_length={train_length!r} is not allowed; allowed: an integer >= 1")
    values = list(multiples)
    if not values:
        raise EvaluationError("multiples is empty; allowed: one or more positive integers, e.g. 1 2 4 8 16")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EvaluationError(
                f"multiple {value!r} is not allowed; allowed: positive integers, e.g. 1 2 4 8 16"
            )
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise EvaluationError(f"multiples {values} repeat {duplicates}; give each multiple once")
    if min(values) * train_length < 2:
        raise EvaluationError(
            f"the shortest evaluation length is {min(values) * train_length} token(s); allowed: >= 2 "
            "(a window needs one token to predict from)"
        )
    return values


def token_budget(available: int, lengths: Sequence[int], max_tokens: int | None = None) -> int:
    """How many leading tokens every length reads.

    The first ``max_tokens`` tokens (default: all ``available``), cut down to a whole number
    of windows of the longest length — and of every length when their least common multiple
    fits, so each length reads exactly the same tokens.
    """
    longest = max(lengths)
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < longest):
        raise EvaluationError(
            f"max_tokens={max_tokens!r} is less than one window of the longest length {longest}; "
            f"allowed: >= {longest}"
        )
    if available < longest:
        raise EvaluationError(
            f"the token stream has {available} tokens but one window of the longest evaluation length "
            f"needs {longest}; add data, or lower --multiples / --train-length"
        )
    budget = available if max_tokens is None else min(max_tokens, available)
    common = math.lcm(*lengths)
    unit = common if budget >= common else longest
    return budget // unit * unit


def check_model_length(model: nn.Module, length: int) -> None:
    """Fail before any work if ``model`` cannot take ``length`` positions (see :func:`position_limit`)."""
    limit = position_limit(model)
    if limit is not None and length > limit[0]:
        raise PositionRangeError(
            f"evaluation length {length} is longer than {limit[1].format(limit[0])}; lower --multiples / "
            f"--train-length to at most {limit[0]} tokens, or evaluate a model patched with an encoding "
            "(or max_positions) that allows it, e.g. --encoding alibi"
        )


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _window_nll(model: nn.Module, ids: torch.Tensor) -> tuple[float, list[float]]:
    """Next-token NLL of the windows in ``ids`` (B, L): (their total, each window's sum), float64.

    The total is reduced exactly as the reports have always reduced it (``cross_entropy``'s own
    fp32 sum per batch or logits chunk, accumulated in float64), so every published loss stays
    identical to the digit; the per-window sums (for the standard error) read the same
    log-probabilities (``cross_entropy`` is ``nll_loss(log_softmax(x))``).
    """
    windows, length = ids.shape
    targets = ids[:, 1:].reshape(-1)  # (B*(L-1),)
    from transformers import PreTrainedModel

    from ...core.registry import adapter_for_config

    def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = logits.float().log_softmax(dim=-1)  # (N, vocab)
        total = F.nll_loss(log_probs, labels, reduction="sum").double()  # == cross_entropy(sum)
        return total, F.nll_loss(log_probs, labels, reduction="none").double()  # (N,)

    # a family whose causal-LM head is a plain ``lm_head(base_model(...))`` gets its logits in
    # chunks, so a long window never materialises (L, vocab) fp32 logits at once
    adapter = adapter_for_config(getattr(model, "config", None))
    head = None
    if (
        isinstance(model, PreTrainedModel) and adapter is not None and adapter.plain_lm_head
    ):  # not a PeftModel
        head = model.get_output_embeddings()
    if head is None or not isinstance(model, PreTrainedModel):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        total, nll = token_nll(logits.reshape(-1, logits.shape[-1]), targets)
        return total.item(), nll.view(windows, length - 1).sum(dim=1).tolist()
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (B*(L-1), hidden)
    step = max(1, CHUNK_ELEMENTS // head.out_features)
    total = torch.zeros((), dtype=torch.float64, device=ids.device)
    nll = torch.empty(hidden.shape[0], dtype=torch.float64, device=ids.device)  # (B*(L-1),)
    for start in range(0, hidden.shape[0], step):
        chunk_total, chunk_nll = token_nll(head(hidden[start : start + step]), targets[start : start + step])
        total += chunk_total
        nll[start : start + step] = chunk_nll
    return total.item(), nll.view(windows, length - 1).sum(dim=1).tolist()


def evaluate_lengths(
    model: nn.Module,
    tokens: torch.Tensor,
    train_length: int,
    multiples: Sequence[int] = (1, 2, 4, 8, 16),
    max_tokens: int | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> list[LengthResult]:
    """Mean next-token loss of ``model`` at ``multiple * train_length`` for each multiple.

    ``tokens`` is a 1-D token stream (e.g. from :func:`hf_posenc.recipes.data.tokenize_documents`).
    Each length reads the same leading tokens (see :func:`token_budget`), cut into
    non-overlapping windows, ``batch_size`` windows per forward. The loss is the sum of
    every predicted token's NLL divided by their count. Runs in eval mode under
    ``torch.no_grad`` (the model's training flag is restored afterwards); ``device`` moves
    the model there (default: where the model is). Errors come before any forward pass.
    """
    multiples = check_multiples(multiples, train_length)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise EvaluationError(f"tokens must be a 1-D integer tensor (a token stream); got {shape}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise EvaluationError(f"batch_size={batch_size!r} is not allowed; allowed: an integer >= 1")
    lengths = [m * train_length for m in multiples]
    budget = token_budget(tokens.numel(), lengths, max_tokens)
    check_model_length(model, max(lengths))

    from tqdm.auto import tqdm

    if device is not None:
        model.to(device)
    device = _model_device(model)
    stream = tokens[:budget].to(device=device, dtype=torch.long)
    was_training = model.training
    model.eval()
    results: list[LengthResult] = []
    total = sum(budget // length * length for length in lengths)
    try:
        with torch.no_grad(), tqdm(total=total, unit="tok", unit_scale=True, disable=not progress) as bar:
            for multiple, length in zip(multiples, lengths, strict=True):
                bar.set_description(f"ev={multiple} (L={length})")
                count = budget // length
                windows = stream[: count * length].view(count, length)  # (windows, L)
                nll, sums = 0.0, []
                for start in range(0, count, batch_size):
                    batch = windows[start : start + batch_size]
                    batch_total, batch_sums = _window_nll(model, batch)
                    nll += batch_total
                    sums += batch_sums
                    bar.update(batch.numel())
                predicted = count * (length - 1)
                loss = nll / predicted
                perplexity = math.exp(loss) if loss < 700 else math.inf
                stderr = standard_error([s / (length - 1) for s in sums])
                results.append(LengthResult(multiple, length, count, predicted, loss, perplexity, stderr))
    finally:
        model.train(was_training)
    return results
