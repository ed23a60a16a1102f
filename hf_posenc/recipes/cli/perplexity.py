"""``hf-posenc perplexity``: loss at 1x, 2x, 4x, ... the training length, for several models.

    hf-posenc perplexity --model runs/expe runs/rope --data valid.jsonl --train-length 512 \\
        --multiples 1 2 4 8 16 --output reports/extrapolation

Each model directory holds a checkpoint and its tokenizer. A checkpoint saved from a
patched model is re-patched from its ``config.posenc``; a plain one is evaluated natively,
or patched with ``--encoding`` first. ``--encoding-param`` on a saved patched checkpoint
changes inference-time parameters for the evaluation only (``hf_posenc.reconfigure``), e.g.
position interpolation of a model trained unscaled::

    hf-posenc perplexity --model runs/expe/final --encoding-param scaling='{"type":"linear","factor":2}' ...

and its row is labelled ``expe (expe, x0.5 at eval)`` (the run's name for ``runs/expe/final``). ``--encoding`` naming an encoding that
extends the saved one without training evaluates the run with it, its RoPE settings carried over::

    hf-posenc perplexity --model runs/rope/final --encoding selfextend --encoding-param window=64 \
        --encoding-param group_size=32 ...

(``rope (selfextend, group_size=32, window=64 at eval)``). Every input is checked (model directories and
tokenizers, data sources, the output directory, encoding parameters, enough tokens, learned
tables, or a family's native limit, long enough) before any model is loaded. Prints the table
and writes results.txt, results.csv, results.json and loss_vs_length.png to ``--output``.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    refuse_unread_source_options,
)
from .model_plan import DTYPES, Plan, check_model_dir, model_labels, plan_model, tokenizer_key


def _token_stream(args: argparse.Namespace, tokenizer):
    """The data sources' token stream for ``tokenizer``; reading stops once ``--max-tokens`` are in."""
    import torch

    from ..data import read_documents, tokenize_documents

    pieces, count = [], 0
    try:
        for document in read_documents(
            args.data, text_field=args.text_field, split=args.split, limit=args.max_documents
        ):
            piece = tokenize_documents([document], tokenizer)
            pieces.append(piece)
            count += piece.numel()
            if args.max_tokens is not None and count >= args.max_tokens:
                break
    except KeyError as error:
        raise EvaluationError(f"data: {error.args[0]}") from error
    except ValueError as error:  # malformed JSON, undecodable text
        raise EvaluationError(f"data: cannot read {args.data}: {error}") from error
    except ImportError as error:
        raise EvaluationError(
            f"data: hf: sources need the datasets package (pip install datasets): {error}"
        ) from error
    if not pieces:
        raise EvaluationError(f"the data sources {args.data} yielded no documents")
    return torch.cat(pieces)


@dataclasses.dataclass
class Checked:
    """What ``command_perplexity`` checked before loading anything: where to write, the models and
    how each is evaluated, the lengths, the device."""

    output: Path
    directories: list[Path]
    multiples: list[int]
    lengths: list[int]
    params: dict[str, Any]
    device: str
    plans: list[Plan]
    labels: list[str]


def check_inputs(args: argparse.Namespace) -> Checked:
    """Every flag, the output folder, the model folders, the data sources, the encoding request and
    each model's position limit, before any model or data is loaded; paths and values before torch
    and transformers are imported (a missing model folder is answered at once)."""
    from ..data import check_sources
    from ..evaluation.report import FILE_NAMES, check_fresh_output
    from ..threads import check_threads

    output = check_fresh_output(args.output, FILE_NAMES["json"], overwrite=args.overwrite)
    directories = [check_model_dir(d) for d in args.model]
    check_sources(args.data)
    refuse_unread_source_options(given_flags(args), args.data)  # a --split / --text-field no source reads
    from ...core.request import check_request
    from ..evaluation.perplexity import check_multiples

    multiples = check_multiples(args.multiples, args.train_length)
    lengths = [m * args.train_length for m in multiples]
    for name, value in (
        ("--batch-size", args.batch_size),
        ("--max-tokens", args.max_tokens),
        ("--max-documents", args.max_documents),
    ):
        if value is not None and value < 1:
            raise EvaluationError(f"{name} {value} is not allowed; allowed: >= 1")
    check_threads(args.threads)
    params = parse_encoding_params(args.encoding_param)
    if args.encoding is not None:
        check_request(args.encoding, params)  # unknown name / bad value / a pattern refusing an entry
    device = checked_device(args.device)
    plans = [plan_model(str(d), args.encoding, params, max(lengths)) for d in directories]
    labels = model_labels(args, plans, params)
    return Checked(output, directories, multiples, lengths, params, device, plans, labels)


def read_token_streams(args: argparse.Namespace, checked: Checked) -> list[tuple[Any, int]]:
    """(token stream, token budget) per model; models sharing a tokenizer share the stream. Too few
    tokens for the longest length fails here, before any model loads."""
    from transformers import AutoTokenizer

    from ..evaluation.perplexity import token_budget

    streams: dict[str, Any] = {}
    model_streams = []
    for directory in checked.directories:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        key = tokenizer_key(tokenizer)
        if key not in streams:
            streams[key] = _token_stream(args, tokenizer)
        tokens = streams[key]
        model_streams.append((tokens, token_budget(tokens.numel(), checked.lengths, args.max_tokens)))
    return model_streams


def run_metadata(args: argparse.Namespace, checked: Checked) -> dict[str, Any]:
    """The settings and provenance results.json records (``models`` is filled as they finish)."""
    from ..provenance import provenance

    return {
        "data": list(args.data),
        "multiples": checked.multiples,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "device": checked.device,
        "batch_size": args.batch_size,
        "models": {},
        "provenance": provenance(),
    }


def evaluate_model(
    args: argparse.Namespace,
    checked: Checked,
    number: int,
    tokens: Any,
    budget: int,
    metadata: dict[str, Any],
) -> list[Any]:
    """Load model ``number``, measure its loss at every length, record it in ``metadata`` and print it."""
    import torch

    from ...core.loading import load_model
    from ..evaluation.perplexity import evaluate_lengths
    from ..threads import use_threads

    directory, label, plan = checked.directories[number], checked.labels[number], checked.plans[number]
    print(
        f"[{number + 1}/{len(checked.directories)}] {label}: {directory}, {budget} of {tokens.numel()} tokens"
    )
    start = time.perf_counter()
    model = load_model(
        str(directory), args.encoding, checked.params or None, dtype=getattr(torch, args.dtype)
    )
    metadata["provenance"]["threads"] = use_threads(args.threads, model).as_dict()
    results = evaluate_lengths(
        model,
        tokens,
        args.train_length,
        checked.multiples,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        device=checked.device,
        progress=not args.no_progress,
    )
    seconds = time.perf_counter() - start
    metadata["models"][label] = {
        "path": str(directory),
        "encoding": plan.encoding,
        "encoding_params": plan.params,
        "eval_overrides": plan.eval_overrides,
        "token_budget": budget,
        "seconds": round(seconds, 3),
    }
    print("  " + ", ".join(f"ev={r.multiple}: {r.loss:.4f}" for r in results) + f"  ({seconds:.1f}s)")
    del model
    if checked.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def write_partial_results(args, checked: Checked, results, metadata, kinds, title: str) -> None:
    """results.csv and results.json of the models finished so far (they survive a later model's failure)."""
    from ..evaluation.report import FILE_NAMES, write_csv, write_json

    write_csv(results, checked.output / FILE_NAMES["csv"], metadata=metadata, kinds=kinds)
    write_json(
        results,
        checked.output / FILE_NAMES["json"],
        train_length=args.train_length,
        title=title,
        metadata=metadata,
        kinds=kinds,
    )


def write_final_report(args, checked: Checked, results, metadata, kinds, title: str) -> None:
    """Every results file and the plot; the table and the paths on screen."""
    from ..evaluation.ranking import result_warnings
    from ..evaluation.report import format_table, write_report

    paths = write_report(results, checked.output, args.train_length, title, metadata=metadata, kinds=kinds)
    print()
    print(format_table(results, perplexity=args.perplexity, kinds=kinds, warnings=result_warnings(results)))
    print()
    for kind, path in paths.items():
        print(f"{kind:>5}: {path}")


def command_perplexity(args: argparse.Namespace) -> int:
    checked = check_inputs(args)  # everything is checked before the first model is loaded
    with run_lock.holding(checked.output, "perplexity run"):  # a second run into it: one line
        return _evaluate_models(args, checked)


def _evaluate_models(args: argparse.Namespace, checked: Checked) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    streams = read_token_streams(args, checked)
    metadata = run_metadata(args, checked)
    kinds = {
        label: "eval-only"
        for label, plan in zip(checked.labels, checked.plans, strict=True)
        if plan.eval_overrides
    }
    title = args.title or f"Loss at multiples of the training length ({args.train_length} tokens)"
    results: dict[str, list] = {}
    for number, (tokens, budget) in enumerate(streams):
        results[checked.labels[number]] = evaluate_model(args, checked, number, tokens, budget, metadata)
        write_partial_results(args, checked, results, metadata, kinds, title)
    write_final_report(args, checked, results, metadata, kinds, title)
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "perplexity",
        help="loss/perplexity at 1x, 2x, 4x, ... the training length (length extrapolation)",
        description="Loss and perplexity of one or more models at 1x, 2x, 4x, ... their training length: "
        "non-overlapping windows, the same tokens at every length. Prints a table and writes results.txt, "
        "results.csv, results.json and loss_vs_length.png to --output.",
    )
    parser.add_argument(
        "--model", nargs="+", required=True, metavar="DIR", help="model directories (with tokenizer)"
    )
    add_model_overrides(parser)
    parser.add_argument(
        "--data", nargs="+", required=True, metavar="SRC", help="file, dir, glob, builtin:stdlib, hf:NAME"
    )
    parser.add_argument(
        "--train-length",
        "--seq-len",
        dest="train_length",
        type=int,
        required=True,
        help="the models' training sequence length",
    )
    parser.add_argument(
        "--multiples",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        metavar="K",
        help="evaluation lengths as multiples of --train-length",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="token budget (default: all the data)")
    parser.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    parser.add_argument("--text-field", default="text", help="JSON field holding the text")
    parser.add_argument("--split", default="validation", help="split of hf: datasets / builtin:stdlib")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the models")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    add_threads_argument(parser)
    parser.add_argument(
        "--output-dir",
        "--output",
        dest="output",
        required=True,
        metavar="DIR",
        help="where results.* and the plot go",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier run in --output-dir"
    )
    parser.add_argument("--title", default=None, help="title of the plot and report")
    parser.add_argument("--perplexity", action="store_true", help="also print perplexity columns")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on error")
    parser.set_defaults(run=command_perplexity, _parser=parser)
