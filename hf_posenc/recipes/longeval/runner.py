"""Run a model on the samples: one prefill and a short greedy decode with the KV cache, batched by length.

Every prompt of one task and length has exactly the same number of tokens, so a batch needs no
padding: the rows are stacked and handed to transformers' ``generate`` (greedy, ``use_cache``),
which prefills once and decodes ``max_new_tokens`` steps from the cache, computing the logits of
the last position only; the attention is the model's (a patched model's backend builds no
``(T, T)`` tensor it does not need). Anything with a ``generate(input_ids, attention_mask,
max_new_tokens, ...)`` returning the prompt followed by the new tokens can be scored.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..evaluation.errors import EvaluationError
from .scoring import score
from .task import Sample, Task
from .tasks import TASKS


@dataclasses.dataclass(frozen=True)
class SampleResult:
    sample: Sample
    output: str
    score: float
    seconds: float = 0.0  # the generate call's wall time divided by its batch size


def stop_tokens(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end a generation: the tokenizer's end of text and the model's own (its
    generation config's), as lm-eval's ``HFLM`` stops on both."""
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(config if isinstance(config, list) else [config])]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _generate(
    model: Any, tokenizer: Any, batch: Sequence[Sample], max_new_tokens: int, device: Any
) -> list[str]:
    import torch

    rows = [tokenizer(sample.prompt)["input_ids"] for sample in batch]
    if {len(row) for row in rows} != {batch[0].length}:
        raise EvaluationError(
            f"{batch[0].task}: prompts of {sorted({len(row) for row in rows})} tokens where {batch[0].length} were "
            "built; evaluate with the tokenizer the samples were built for"
        )
    ids = torch.tensor(rows, dtype=torch.long, device=device)  # (B, T): one length, no padding
    stops = stop_tokens(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=pad,
            eos_token_id=stops or None,
        )
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]


def generation_budget(task: Task, tokenizer: Any, samples: Sequence[Sample]) -> int:
    """Greedy tokens to generate for ``samples`` (all of one task and length): the source's budget
    (``task.max_new_tokens``), raised to what the longest expected answer takes in this tokenizer
    plus 8 (RULER sized its budgets for Llama's tokenizer; a character-level vocabulary needs more
    to write five variable names)."""
    needed = max(
        len(tokenizer(" " + ", ".join(sample.answers), add_special_tokens=False)["input_ids"])
        for sample in samples
    )
    return max(task.max_new_tokens, needed + 8)


def evaluate_samples(
    model: Any,
    tokenizer: Any,
    samples: Iterable[Sample],
    *,
    batch_size: int = 1,
    device: Any = None,
    progress: Callable[[int], None] | None = None,
) -> list[SampleResult]:
    """Generate for every sample (batches of ``batch_size`` prompts of one task and length) and score it."""
    results: list[SampleResult] = []
    ordered = sorted(samples, key=lambda s: (list(TASKS).index(s.task), s.length))
    for (task_name, _), group in itertools.groupby(ordered, key=lambda s: (s.task, s.length)):
        task = TASKS[task_name]
        members = list(group)
        budget = generation_budget(task, tokenizer, members)  # one budget per task and length
        for start in range(0, len(members), batch_size):
            batch = members[start : start + batch_size]
            began = time.perf_counter()
            outputs = _generate(model, tokenizer, batch, budget, device)
            seconds = (time.perf_counter() - began) / len(batch)
            for sample, output in zip(batch, outputs, strict=True):
                results.append(
                    SampleResult(sample, output, score(task.metric, output, sample.answers), seconds)
                )
            if progress is not None:
                progress(len(batch))
    return results


@dataclasses.dataclass(frozen=True)
class Cell:
    """Accuracy of one task at one length (and depth; ``None``: over every depth)."""

    task: str
    length: int
    depth: float | None
    accuracy: float
    samples: int
    prompt_tokens: int
    seconds_per_sample: float = 0.0  # prefill + decode wall time per prompt (batched)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(results: Sequence[SampleResult]) -> list[Cell]:
    """One cell per (task, length, depth) and one per (task, length) over all depths (``depth=None``)."""
    cells: list[Cell] = []
    keyed = sorted(results, key=lambda r: (list(TASKS).index(r.sample.task), r.sample.length))
    for (task, length), group in itertools.groupby(keyed, key=lambda r: (r.sample.task, r.sample.length)):
        members = list(group)
        depths = sorted({r.sample.depth for r in members if r.sample.depth is not None})
        for depth in [*depths, None]:
            at = [r for r in members if depth is None or r.sample.depth == depth]
            accuracy = sum(r.score for r in at) / len(at)
            seconds = round(sum(r.seconds for r in at) / len(at), 4)
            cells.append(Cell(task, length, depth, accuracy, len(at), length, seconds))
    return cells
