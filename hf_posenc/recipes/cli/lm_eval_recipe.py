"""``hf-posenc lm-eval``'s recipe mode: HellaSwag, MMLU, ARC-Easy and ARC-Challenge with each task's
own shot count (and the generated retrieval tasks, ``passkey_4096``), on the hub datasets or on
local files, for one or several checkpoints, with one comparison table. Every input is checked
before any model is loaded. The command, its options and the passthrough mode are in
:mod:`hf_posenc.recipes.cli.lm_eval`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import write_text
from ..integrations.lm_eval_tasks import BenchmarkError


def _parse_model_args(tokens: Sequence[str]) -> dict[str, Any]:
    from lm_eval.utils import simple_parse_args_string

    text = ",".join(tokens)
    if text.lstrip().startswith("{"):
        return json.loads(text)
    return simple_parse_args_string(text)


def _label(args: dict[str, Any], model: str = "hf-posenc") -> str:
    """``folder-name (encoding)``: the requested encoding, else the one a patched checkpoint carries;
    a patched checkpoint evaluated with overridden encoding parameters says so
    (``expe (expe, x0.5 at eval)`` for ``runs/expe/final``: the run's name, see ``run_name``)."""
    from ..evaluation.labels import encoding_label, run_name

    path = os.path.expanduser(str(args.get("pretrained", "model")))
    encoding = args.get("encoding")
    overrides: dict[str, Any] = {}
    if encoding is None and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            encoding = (json.load(handle).get("posenc") or {}).get("encoding")
        if encoding is not None and model == "hf-posenc":
            from ..integrations.lm_eval_model import split_model_args

            overrides = split_model_args(args).encoding_params
    name = run_name(path)
    return f"{name} ({encoding_label(encoding, overrides)})" if encoding else name


def collect_models(opts: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, model_args) per model: each --pretrained DIR (plus the shared model_args), each model_args."""
    entries = [_parse_model_args(tokens) for tokens in opts.model_args]
    shared = {}
    for entry in entries:
        if "pretrained" not in entry:
            shared.update(entry)
    models = [{"pretrained": path, **shared} for path in opts.pretrained or []]
    models += [entry for entry in entries if "pretrained" in entry]
    if not models:
        if opts.model == "hf-posenc":
            raise BenchmarkError(
                "no checkpoint: give --pretrained DIR [DIR ...] or --model_args pretrained=DIR"
            )
        models = [shared]
    labels: list[str] = []
    for model in models:
        label = _label(model, opts.model)
        labels.append(label if label not in labels else f"{label} #{len(labels) + 1}")
    return list(zip(labels, models, strict=True))


def ensure_writable_dir(path: str) -> Path:
    """Create ``path`` if needed; raise a clear error unless it is a writable directory."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"--output {path!r} exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (NotADirectoryError, FileExistsError) as error:
        raise NotADirectoryError(f"--output {path!r} cannot be created: {error}") from None
    except PermissionError:
        raise PermissionError(f"--output {path!r} is not writable") from None
    return folder


def _evaluate(opts: argparse.Namespace, label: str, model_args: dict, task_names: list[str], task_manager):
    """One simple_evaluate call; saves lm-eval's JSON under --output. Returns results, or None off rank 0."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from ..integrations.lm_eval_model import quiet_git_probe

    quiet_git_probe()

    tracker = EvaluationTracker(output_path=str(opts.output)) if opts.output else None
    limit = int(opts.limit) if opts.limit is not None and opts.limit >= 1 else opts.limit
    seeds = (
        {}
        if opts.seed is None
        else dict.fromkeys(
            ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), opts.seed
        )
    )
    results = lm_eval.simple_evaluate(
        model=opts.model,
        model_args=model_args,
        tasks=task_names,
        num_fewshot=None,
        batch_size=opts.batch_size,
        max_batch_size=opts.max_batch_size,
        device=opts.device,
        limit=limit,
        log_samples=opts.log_samples,
        evaluation_tracker=tracker,
        task_manager=task_manager,
        **seeds,
    )
    if results is None or tracker is None:
        return results
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples if opts.log_samples else None)
    if opts.log_samples and samples:
        for name in results["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
    config = tracker.general_config_tracker
    written = Path(opts.output) / str(config.model_name_sanitized) / f"results_{tracker.date_id}.json"
    if not written.is_file():
        raise PermissionError(f"lm-eval could not write its results to {written}")
    print(f"{label}: results written to {written}", flush=True)
    return results


def _split_tasks(opts: argparse.Namespace) -> tuple[dict[str, int], list[str]]:
    """({benchmark task: shots}, [retrieval tasks like passkey_4096]) of the request."""
    from ..integrations.lm_eval_longeval import parse_task_name
    from ..integrations.lm_eval_tasks import select_tasks

    tasks = [t for token in opts.tasks or [] for t in token.split(",") if t]
    retrieval = [t for t in dict.fromkeys(tasks) if parse_task_name(t) is not None]
    others = [t for t in tasks if t not in retrieval]
    wanted = others or opts.preset or not retrieval
    return (select_tasks(others, opts.preset, opts.num_fewshot) if wanted else {}), retrieval


def _retrieval_configs(
    opts: argparse.Namespace,
    models: list[tuple[str, dict[str, Any]]],
    retrieval: list[str],
    runs,
    folder: Path,
) -> list[tuple[Any, list[str], dict[str, Any]]]:
    """Per model: (task manager, task names, model_args) with the retrieval tasks built for its tokenizer
    (models sharing a tokenizer share the folder); ``max_length`` set so lm-eval cuts no prompt."""
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from ..integrations.lm_eval_longeval import GROUP
    from ..integrations.lm_eval_longeval import write_task_configs as write_retrieval
    from ..integrations.lm_eval_tasks import write_task_configs
    from ..longeval.tasks import DEFAULT_DEPTHS, check_depths, check_samples
    from .model_plan import tokenizer_key

    depths = check_depths(opts.depths if opts.depths is not None else DEFAULT_DEPTHS)
    samples = check_samples(opts.samples)
    seed = opts.seed if opts.seed is not None else 0
    prepared: list[tuple[Any, list[str], dict[str, Any]]] = []
    built: dict[str, tuple[Any, list[str], int]] = {}
    for label, model_args in models:
        source = os.path.expanduser(str(model_args.get("tokenizer") or model_args["pretrained"]))
        tokenizer = AutoTokenizer.from_pretrained(source)
        key = tokenizer_key(tokenizer)
        if key not in built:
            sub = folder / f"tokenizer-{len(built)}"
            names = write_task_configs(runs, sub) if runs else []
            longest = write_retrieval(
                sub,
                retrieval,
                tokenizer,
                depths=depths,
                samples=samples,
                seed=seed,
                where=f"the tokenizer of {label}",
            )
            built[key] = (
                TaskManager(include_path=str(sub), include_defaults=False),
                [*names, GROUP],
                longest,
            )
        manager, names, longest = built[key]
        prepared.append((manager, names, {"max_length": longest, **model_args}))
    return prepared


def run_recipe(opts: argparse.Namespace) -> int:
    """Check every input, then evaluate each model on the planned tasks and print the table."""
    from ..preflight import check_model_path

    for path in opts.pretrained or []:  # a missing folder is answered before lm-eval is imported
        check_model_path(path, what="--pretrained")
    models = collect_models(opts)
    from ..integrations.lm_eval_longeval import GROUP
    from ..integrations.lm_eval_report import comparison_rows, format_table
    from ..integrations.lm_eval_tasks import plan_tasks, write_task_configs

    shots, retrieval = _split_tasks(opts)
    if opts.mmlu_subjects and "mmlu" not in shots:
        raise BenchmarkError("--mmlu-subjects needs mmlu among the tasks")
    runs = plan_tasks(shots, opts.data_dir, opts.mmlu_subjects)
    if opts.model == "hf-posenc":
        from ..integrations.lm_eval_model import check_model_args, split_model_args

        for _, model_args in models:
            check_model_args(split_model_args(model_args))
    if opts.output:
        opts.output = ensure_writable_dir(opts.output)
    elif opts.log_samples:
        raise BenchmarkError("--log_samples needs --output DIR")

    from lm_eval.tasks import TaskManager
    from lm_eval.utils import setup_logging

    setup_logging()  # lm-eval's progress messages, as its own CLI shows them
    finished = []
    with tempfile.TemporaryDirectory(prefix="hf-posenc-lm-eval-") as folder:
        if retrieval:  # prompts of exactly each length in each model's tokens, built before any model loads
            prepared = _retrieval_configs(opts, models, retrieval, runs, Path(folder))
        else:
            task_names = write_task_configs(runs, folder)
            task_manager = TaskManager(include_path=folder, include_defaults=False)
            prepared = [(task_manager, task_names, model_args) for _, model_args in models]
        source = f"local files in {opts.data_dir}" if opts.data_dir else "hub datasets"
        plan = ", ".join(f"{name} {count}-shot" for name, count in shots.items())
        if retrieval:
            plan = ", ".join(filter(None, [plan, f"{', '.join(retrieval)} (generated)"]))
        for number, ((label, _), (manager, names, model_args)) in enumerate(
            zip(models, prepared, strict=True), 1
        ):
            print(f"[{number}/{len(models)}] {label}: {plan} on {source}", flush=True)
            results = _evaluate(opts, label, model_args, names, manager)
            if results is not None:
                finished.append((label, results))
    if not finished:  # not the main process of a distributed run
        return 0
    table = format_table(
        *comparison_rows(
            finished, {**shots, **dict.fromkeys(retrieval, 0), **({GROUP: 0} if retrieval else {})}
        )
    )
    print(table)
    if opts.output:
        from ..provenance import provenance

        record = provenance()
        versions = ", ".join(f"{k} {v}" for k, v in record["versions"].items())
        footer = (
            f"\n\nvalue: lm-eval's metric (accuracies as fractions of 1); ± stderr: its standard error over the "
            f"n examples scored.\n\ndate: {record['date']}  \ngit commit: {record['git_commit']}  \n"
            f"versions: {versions}  \ncommand: `{record['command']}`\n"
        )
        write_text(Path(opts.output) / "comparison.md", table + footer)
    return 0
