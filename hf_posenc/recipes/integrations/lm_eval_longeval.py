"""The long-context retrieval tasks as lm-eval tasks: ``passkey_4096``, ``niah_single_2048``, ... .

One lm-eval task per task and length (``<task>_<length>``), all in the group ``longeval``. Their
documents are the samples :mod:`hf_posenc.recipes.longeval` generates for the evaluated model's
tokenizer (exactly ``length`` tokens each; the same prompts ``hf-posenc longeval`` scores for the
same seed, depths and sample count), written as a local JSON-lines file next to the task's YAML,
so nothing is downloaded. Each task is ``output_type: generate_until`` (greedy, the generation
budget ``hf-posenc longeval`` uses, stopping only at the end of text) and its metric ``score`` is
the task's own (first integer for the passkey; RULER's all-match for RULER's tasks), averaged
over the documents: the ``depth: null`` accuracy of ``hf-posenc longeval``.

lm-eval's ``HFLM`` truncates a prompt to its ``max_length`` minus the generation budget from the
left; the recipe sets ``max_length`` so no prompt is cut.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..evaluation.errors import EvaluationError
from ..longeval.runner import generation_budget
from ..longeval.scoring import score
from ..longeval.task import Task
from ..longeval.tasks import TASKS, check_tokenizer, minimum_length, task_samples

GROUP = "longeval"
NAME = re.compile(r"^(?P<task>[a-z0-9_]+?)_(?P<length>[1-9][0-9]*)$")
#: the module lm-eval imports for ``process_results`` (written next to the YAMLs)
UTILS = "longeval_utils"


def parse_task_name(name: str) -> tuple[Task, int] | None:
    """``("passkey", 4096)`` for ``passkey_4096``; None for a name that is not a retrieval task."""
    match = NAME.match(name)
    if (
        name in TASKS or match is None or match["task"] not in TASKS
    ):  # niah_multikey_2 is a task, not a length
        return None
    return TASKS[match["task"]], int(match["length"])


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval's per-document hook: the task's score of the generated text."""
    return {"score": score(doc["metric"], results[0], doc["answers"])}


def write_task_configs(
    folder: Path,
    names: Sequence[str],
    tokenizer: Any,
    *,
    depths: Sequence[float],
    samples: int,
    seed: int,
    where: str,
) -> int:
    """Write, for ``tokenizer``, each task's documents and YAML and the ``longeval`` group into ``folder``.

    Checks the tokenizer and each length against the task's minimum first (one line naming
    ``where``); returns the longest prompt plus generation budget (the ``max_length`` lm-eval needs).
    """
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{UTILS}.py").write_text(
        "from hf_posenc.recipes.integrations.lm_eval_longeval import process_results  # noqa: F401\n",
        encoding="utf-8",
    )
    longest = 0
    for name in names:
        parsed = parse_task_name(name)
        if parsed is None:
            raise EvaluationError(
                f"{name!r} is not a retrieval task; allowed: <task>_<length> with task in {', '.join(TASKS)}"
            )
        task, length = parsed
        check_tokenizer(task, tokenizer, where, seed)
        shortest = minimum_length(task, tokenizer, length, samples, seed)
        if length < shortest:
            raise EvaluationError(
                f"{name}: {length} is under {task.name}'s minimum of {shortest} tokens for {where}"
            )
        built = list(task_samples(task, tokenizer, length, depths, samples, seed))
        budget = generation_budget(task, tokenizer, built)
        longest = max(longest, length + budget)
        data = folder / f"{name}.jsonl"
        with data.open("w", encoding="utf-8") as handle:
            for sample in built:
                row = {
                    "prompt": sample.prompt,
                    "answers": list(sample.answers),
                    "metric": task.metric,
                    "depth": sample.depth,
                    "index": sample.index,
                    "tokens": sample.tokens,
                }
                handle.write(json.dumps(row) + "\n")
        config = {
            "task": name,
            "tag": [f"{GROUP}_{task.name}"],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answers[0]}}",
            "target_delimiter": "",
            "generation_kwargs": {"until": [], "max_gen_toks": budget, "do_sample": False},
            "process_results": f"!function {UTILS}.process_results",
            "metric_list": [{"metric": "score", "aggregation": "mean", "higher_is_better": True}],
            "num_fewshot": 0,
            "metadata": {"version": 1.0, "source": task.citation, "depths": list(depths), "seed": seed},
        }
        text = yaml.safe_dump(config, sort_keys=False).replace(
            f"'!function {UTILS}.process_results'", f"!function {UTILS}.process_results"
        )
        (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
    group = {
        "group": GROUP,
        "task": list(names),
        "aggregate_metric_list": [{"metric": "score", "aggregation": "mean", "weight_by_size": False}],
        "metadata": {"version": 1.0},
    }
    (folder / f"_{GROUP}.yaml").write_text(yaml.safe_dump(group, sort_keys=False), encoding="utf-8")
    return longest
