"""``hf-posenc longeval``: passkey and RULER retrieval accuracy at several prompt lengths, for several models.

    hf-posenc longeval --model runs/rope/final runs/alibi/final --tasks passkey niah_multikey vt cwe fwe \\
        --lengths 512 1024 2048 4096 --samples 20 --output-dir reports/retrieval

Models are given and overridden exactly as ``hf-posenc perplexity`` takes them (a checkpoint saved
from a patched model with its encoding, ``--encoding-param`` changing its inference-time
parameters for the evaluation; a plain one natively or with ``--encoding``). Every input is
checked and every prompt built (exactly each length in each model's tokens) before the first
model loads. Prints the table and writes results.json, results.md, heatmap_<model>.png and
accuracy_vs_length.png to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .. import run_lock
from ..evaluation.errors import EvaluationError
from .common import (
    add_model_overrides,
    add_threads_argument,
    checked_device,
    given_flags,
    parse_encoding_params,
    refuse_ignored_flags,
)
from .model_plan import DTYPES, Plan, check_model_dir, model_labels, plan_model, tokenizer_key

DEFAULT_TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vt", "fwe")


def check_output(path: str, overwrite: bool) -> Path:
    """A writable folder that holds no other run's results (unless ``overwrite``)."""
    from ..evaluation.report import check_fresh_output
    from ..longeval.report import FILE_NAMES

    return check_fresh_output(path, FILE_NAMES["json"], overwrite=overwrite, flag="--output-dir")


def train_length_of(directory: Path, given: int | None) -> int | None:
    """``--train-length``, else the ``seq_len`` an ``hf-posenc train`` run recorded next to the checkpoint."""
    if given is not None:
        return given
    record = directory / "training_run.json"
    if record.is_file():
        try:
            return int(json.loads(record.read_text(encoding="utf-8"))["config"]["seq_len"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def check_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Every check that needs no model: flags, tasks, output folder, model folders, encoding request."""
    from ...core.request import check_request
    from ..longeval.tasks import check_depths, check_lengths, check_samples, check_tasks
    from ..threads import check_threads

    tasks = check_tasks(args.tasks)
    lengths = check_lengths(args.lengths)
    depths = check_depths(args.depths)
    placed = any(task.uses_depth for task in tasks)  # --depths for tasks that place nothing at a depth
    rules = [
        (
            ("depths",),
            placed,
            "with only tasks that have no depth",
            "add a task placed at a depth (passkey, niah_*)",
        )
    ]
    refuse_ignored_flags("", given_flags(args), rules)
    check_samples(args.samples)
    if args.batch_size < 1:
        raise EvaluationError(f"--batch-size {args.batch_size} is not allowed; allowed: >= 1")
    if args.train_length is not None and args.train_length < 1:
        raise EvaluationError(f"--train-length {args.train_length} is not allowed; allowed: >= 1")
    check_threads(args.threads)
    output = check_output(args.output, args.overwrite)
    directories = [check_model_dir(d) for d in args.model]
    params = parse_encoding_params(args.encoding_param)
    if args.encoding is not None:
        check_request(args.encoding, params)
    device = checked_device(args.device)
    longest = max(lengths) + max(task.max_new_tokens for task in tasks)  # the prompt and what is generated
    plans = [plan_model(str(d), args.encoding, params, longest, shorten="--lengths") for d in directories]
    return {
        "tasks": tasks,
        "lengths": lengths,
        "depths": depths,
        "output": output,
        "directories": directories,
        "params": params,
        "device": device,
        "plans": plans,
        "labels": model_labels(args, plans, params),
    }


def build_prompts(args: argparse.Namespace, checked: dict[str, Any]) -> list[tuple[Any, list[Any]]]:
    """(tokenizer, samples) per model; models sharing a tokenizer share the prompts. Refuses a tokenizer
    that cannot write an answer and a length under a task's minimum, naming the model."""
    from transformers import AutoTokenizer

    from ..longeval.tasks import check_tokenizer, minimum_length, task_samples

    built: dict[str, list[Any]] = {}
    per_model = []
    for directory in checked["directories"]:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        key = tokenizer_key(tokenizer)
        if key not in built:
            samples: list[Any] = []
            for task in checked["tasks"]:
                check_tokenizer(task, tokenizer, f"model {str(directory)!r}", args.seed)
                for length in checked["lengths"]:
                    shortest = minimum_length(task, tokenizer, length, args.samples, args.seed)
                    if length < shortest:
                        raise EvaluationError(
                            f"--lengths {length} is under {task.name}'s minimum of {shortest} tokens for the "
                            f"tokenizer of {str(directory)!r}; use lengths >= {shortest} or drop {task.name}"
                        )
                    samples += task_samples(
                        task, tokenizer, length, checked["depths"], args.samples, args.seed
                    )
            built[key] = samples
        per_model.append((tokenizer, built[key]))
    return per_model


def evaluate_model(args, checked, number: int, prompts: tuple[Any, list[Any]]):
    """Load model ``number`` and score it on its prompts; returns (cells, metadata entry)."""
    import torch
    from tqdm.auto import tqdm

    from ...core.loading import load_model
    from ..longeval.runner import evaluate_samples, summarize
    from ..threads import use_threads

    directory, plan, label = (
        checked["directories"][number],
        checked["plans"][number],
        checked["labels"][number],
    )
    tokenizer, samples = prompts
    print(
        f"[{number + 1}/{len(checked['directories'])}] {label}: {directory}, {len(samples)} prompts",
        flush=True,
    )
    start = time.perf_counter()
    model = load_model(
        str(directory), args.encoding, checked["params"] or None, dtype=getattr(torch, args.dtype)
    )
    threads = use_threads(args.threads, model).as_dict()
    model.to(checked["device"]).eval()
    with tqdm(total=len(samples), unit="prompt", disable=args.no_progress) as bar:
        results = evaluate_samples(
            model,
            tokenizer,
            samples,
            batch_size=args.batch_size,
            device=checked["device"],
            progress=bar.update,
        )
    seconds = time.perf_counter() - start
    del model
    return summarize(results), _model_metadata(directory, plan, seconds, len(samples), threads, args)


def _model_metadata(
    directory: Path, plan: Plan, seconds: float, prompts: int, threads, args
) -> dict[str, Any]:
    return {
        "path": str(directory),
        "encoding": plan.encoding,
        "encoding_params": plan.params,
        "eval_overrides": plan.eval_overrides,
        "train_length": train_length_of(directory, args.train_length),
        "prompts": prompts,
        "seconds": round(seconds, 3),
        "seconds_per_prompt": round(seconds / max(prompts, 1), 4),
        "threads": threads,
    }


def write_outputs(args, checked, results, metadata, *, final: bool) -> dict[str, Path]:
    """results.json (and, when ``final``, results.md and the pictures) in the output folder."""
    from ..longeval import report

    output: Path = checked["output"]
    settings = {
        "tasks": [task.name for task in checked["tasks"]],
        "lengths": checked["lengths"],
        "depths": checked["depths"],
        "samples": args.samples,
        "seed": args.seed,
        "dtype": args.dtype,
        "device": checked["device"],
        "batch_size": args.batch_size,
    }
    paths = {
        "json": report.write_json(
            output / report.FILE_NAMES["json"], results, settings=settings, metadata=metadata
        )
    }
    if not final:
        return paths
    train_lengths = {label: metadata["models"][label]["train_length"] for label in results}
    title = args.title or "Retrieval accuracy against prompt length"
    pictures = []
    for stale in output.glob("heatmap_*.png"):  # a replaced run's pictures (--overwrite)
        stale.unlink()
    for label, cells in results.items():
        picture = report.plot_heatmap(output / report.heatmap_name(label), label, cells, train_lengths[label])
        if picture is not None:
            pictures.append(picture.name)
            paths[f"heatmap {label}"] = picture
    paths["chart"] = report.plot_accuracy(output / report.FILE_NAMES["chart"], results, train_lengths, title)
    pictures.insert(0, paths["chart"].name)
    paths["markdown"] = report.write_markdown(
        output / report.FILE_NAMES["markdown"],
        results,
        title=title,
        train_lengths=train_lengths,
        pictures=pictures,
    )
    return paths


def command_longeval(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    checked = check_inputs(args)  # everything is checked before the first model is loaded
    with run_lock.holding(checked["output"], "longeval run"):  # a second run into it: one line
        return _evaluate_models(args, checked)


def _evaluate_models(args: argparse.Namespace, checked: dict[str, Any]) -> int:
    from ..longeval.report import format_table
    from ..provenance import provenance

    prompts = build_prompts(args, checked)
    results: dict[str, Any] = {}
    metadata: dict[str, Any] = {"models": {}, "provenance": provenance()}
    for number, label in enumerate(checked["labels"]):
        cells, entry = evaluate_model(args, checked, number, prompts[number])
        results[label], metadata["models"][label] = cells, entry
        metadata["provenance"]["threads"] = entry["threads"]
        write_outputs(
            args, checked, results, metadata, final=False
        )  # partial results survive a later failure
    paths = write_outputs(args, checked, results, metadata, final=True)
    print()
    print(format_table(results))
    print()
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    from ..longeval.tasks import DEFAULT_DEPTHS, TASKS

    parser = commands.add_parser(
        "longeval",
        help="passkey and RULER retrieval accuracy at several prompt lengths (long-context evaluation)",
        description="Retrieval accuracy of one or more models on the passkey test and RULER's synthetic tasks, "
        "generated offline, each prompt exactly the requested length in the model's tokens. Prints a table and "
        "writes results.json, results.md, a depth x length heatmap per model and accuracy_vs_length.png.",
    )
    parser.add_argument(
        "--model",
        "--pretrained",
        dest="model",
        nargs="+",
        required=True,
        metavar="DIR",
        help="model directories (with tokenizer)",
    )
    add_model_overrides(parser)
    parser.add_argument(
        "--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK", help=f"any of: {', '.join(TASKS)}"
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        metavar="N",
        help="prompt lengths in each model's tokens",
    )
    parser.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=list(DEFAULT_DEPTHS),
        metavar="D",
        help="needle depths, fractions of the text before the needle (tasks with one needle)",
    )
    parser.add_argument("--samples", type=int, default=20, help="samples per task, length and depth")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    parser.add_argument(
        "--train-length",
        "--seq-len",
        dest="train_length",
        type=int,
        default=None,
        help="the models' training length, marked in the pictures (default: read from training_run.json)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="prompts of one length per generate call")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the models")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    add_threads_argument(parser)
    parser.add_argument(
        "--output-dir",
        "--output",
        dest="output",
        required=True,
        metavar="DIR",
        help="where results and pictures go",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier run in --output-dir"
    )
    parser.add_argument("--title", default=None, help="title of the chart and report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on error")
    parser.set_defaults(run=command_longeval, _parser=parser)
