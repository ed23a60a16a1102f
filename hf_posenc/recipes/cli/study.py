"""``hf-posenc study``: the extrapolation study (the main job); offline by default."""

from __future__ import annotations

import argparse
import dataclasses

from ..study import StudyConfig, load_study_config, run_study
from .common import (
    TRACKERS,
    add_run_option,
    add_threads_argument,
    given_flags,
    merge_settings,
    refuse_ignored_flags,
    refuse_unread_source_options,
)


def _defaults() -> argparse.Namespace:
    values = {}
    for field in dataclasses.fields(StudyConfig):
        if field.default is not dataclasses.MISSING:
            values[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            values[field.name] = field.default_factory()
    return argparse.Namespace(**values)


def _tuned(defaults: argparse.Namespace) -> str:
    """The default retrieval setting in words (the one tuned for the embedded default)."""
    instruction = "" if defaults.retrieval_instruction else ", no instruction line"
    return (
        f"{defaults.retrieval_documents} passkey documents, keys 1-{defaults.retrieval_max_key}{instruction}"
    )


def register(commands: argparse._SubParsersAction) -> None:
    defaults = _defaults()  # no StudyConfig(): validating its encodings would import the engine
    parser = commands.add_parser(
        "study",
        help="patch a base model with each encoding, continue pretraining, report loss vs length",
        description="With no arguments: an offline study on the Python standard library's sources, with a tiny "
        "Llama first pretrained with RoPE, switched to rope, alibi, t5, nope, sinusoidal, expe and exqpe, "
        "plus evaluation-only rows: expe/exqpe at scaling factor 2 (the ExPE paper's Table 3), RoPE with "
        "position interpolation and RoPE with SelfExtend, no training; every pretraining mixes in "
        f"{_tuned(defaults)} and the base and every trained row are scored "
        "on the passkey at every evaluation length, a second table (--retrieval-documents 0: no passkey "
        "documents, no second table). How long it takes: README, 'How long the default study takes'.",
    )
    add_run_option(
        parser,
        "config",
        help="YAML/JSON of study settings (e.g. a previous study_config.json); flags given here override it",
    )
    add_run_option(
        parser, "output_dir", default=defaults.output_dir, help="runs, results and the picture go here"
    )
    parser.add_argument(
        "--base-model",
        "--model",
        dest="base_model",
        default=None,
        help="checkpoint (with tokenizer) to start from; default: pretrain the embedded tiny Llama",
    )
    parser.add_argument(
        "--encodings",
        nargs="+",
        default=defaults.encodings,
        metavar="SPEC",
        help='names, optionally with JSON parameters: alibi \'expe{"scaling":{"type":"linear","factor":2}}\'',
    )
    add_run_option(
        parser,
        "data",
        default=defaults.data,
        help="training text: file, dir, glob, builtin:stdlib, hf:NAME",
    )
    add_run_option(parser, "eval_data", help="default: the --eval-split of --data")
    parser.add_argument("--train-split", default=defaults.train_split, help="split of --data trained on")
    add_run_option(parser, "eval_split", default=defaults.eval_split, help="split of --data evaluated on")
    add_run_option(parser, "text_field", default=defaults.text_field, help="JSON field holding the text")
    add_run_option(parser, "max_documents", help="cap on training documents")
    parser.add_argument(
        "--train-length",
        "--seq-len",
        dest="train_length",
        type=int,
        default=defaults.train_length,
        help="training sequence length (tokens); evaluated at multiples of it",
    )
    parser.add_argument(
        "--multiples",
        nargs="+",
        type=int,
        default=defaults.multiples,
        help="evaluation lengths as multiples of --train-length",
    )
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help="continued-pretraining steps per encoding"
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=defaults.pretrain_steps,
        help="steps of RoPE pretraining of the embedded base model",
    )
    add_run_option(parser, "batch_size", default=defaults.batch_size, help="sequences per step")
    add_run_option(parser, "lr", default=defaults.lr, help="peak learning rate")
    add_run_option(
        parser, "eval_tokens", default=defaults.eval_tokens, help="tokens evaluated at every length"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=defaults.vocab_size, help="embedded base model only"
    )
    parser.add_argument(
        "--hidden-size", type=int, default=defaults.hidden_size, help="embedded base model only"
    )
    parser.add_argument(
        "--num-layers", type=int, default=defaults.num_layers, help="embedded base model only"
    )
    add_run_option(parser, "seed", default=defaults.seed)
    add_threads_argument(parser)
    add_run_option(
        parser,
        "report_to",
        help=f"accelerate trackers for every run's training loss and lr (as train --report-to): {TRACKERS}; "
        "each run logs under its own folder",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="train every run with documents packed per block, positions restarting per document",
    )
    parser.add_argument(
        "--retrieval",
        action="store_true",
        help=f"changes nothing, kept so older commands run: the setting it chose ({_tuned(defaults)}) is the "
        "default now",
    )
    parser.add_argument(
        "--retrieval-documents",
        type=int,
        default=defaults.retrieval_documents,
        metavar="N",
        help="passkey documents (one training block each) mixed into every pretraining, then passkey accuracy "
        "at every evaluation length: a second table and retrieval_heatmaps.png (0: off; the "
        "count is tuned for the embedded tiny Llama)",
    )
    parser.add_argument(
        "--retrieval-samples",
        type=int,
        default=defaults.retrieval_samples,
        metavar="N",
        help="passkey prompts per evaluation length and depth (depths 0, 0.5, 1)",
    )
    parser.add_argument(
        "--retrieval-max-key",
        type=int,
        default=defaults.retrieval_max_key,
        metavar="N",
        help="pass keys uniform in [1, N], trained on and scored (Landmark's protocol: 50000)",
    )
    parser.add_argument(
        "--retrieval-instruction",
        action=argparse.BooleanOptionalAction,
        default=defaults.retrieval_instruction,
        help="keep the passkey prompt's instruction line (Landmark's protocol); without it (the default, "
        "--no-retrieval-instruction) the prompt is the filler, the key line and the question",
    )
    parser.add_argument(
        "--eval-only",
        nargs="*",
        default=None,
        metavar="ROW",
        help="rows evaluated without training: TRAINED@{JSON overrides}, TRAINED@interpolate (factor = "
        "length / train length) or TRAINED@ENCODING{JSON} (an encoding extending it: "
        '\'rope@selfextend{"group_size": 32, "window": 64}\', rope@rerope; window/group_size left out '
        "are chosen from the study), TRAINED one of --encodings (default: expe and exqpe at scaling factor 2, "
        "rope@interpolate, rope@selfextend; give --eval-only alone for none)",
    )
    add_run_option(parser, "overwrite", help="retrain runs whose recorded settings differ (else: an error)")
    add_run_option(parser, "dry_run", help="check every input and print the plan; load and train nothing")
    parser.set_defaults(run=command_study, _parser=parser)


def command_study(args: argparse.Namespace) -> int:
    fields = [f.name for f in dataclasses.fields(StudyConfig)]
    file_values = load_study_config(args.config) if args.config else {}
    values = merge_settings(args, fields, file_values)  # flags given on the command line win
    # flags the settings would ignore (the command line only: a study_config.json holds every field)
    embedded = not values.get("base_model")
    rules = [
        (
            ("vocab_size", "hidden_size", "num_layers", "pretrain_steps"),
            embedded,
            "with --base-model (they shape and pretrain the embedded base)",
            "drop --base-model",
        ),
        (
            ("retrieval_samples", "retrieval_max_key", "retrieval_instruction"),
            bool(values.get("retrieval_documents")),
            "with --retrieval-documents 0",
            "give --retrieval-documents N > 0",
        ),
    ]
    given = given_flags(args)
    refuse_ignored_flags("study", given, rules)
    refuse_unread_source_options(given, values.get("data"), values.get("eval_data"), split="train_split")
    if args.retrieval:  # the preset of before is the default now: said, not silently swallowed
        print(
            f"[study] --retrieval changes nothing: its setting ({_tuned(_defaults())}) is the default now; "
            "--retrieval-documents 0 leaves the experiment out",
            flush=True,
        )
    if values.get("base_model"):  # a missing folder is answered before the encodings import torch
        from ..preflight import check_model_path

        check_model_path(values["base_model"], what="--base-model", need_tokenizer=True)
    run_study(StudyConfig(**values), overwrite=args.overwrite, dry_run=args.dry_run)
    return 0
