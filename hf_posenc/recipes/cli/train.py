"""``hf-posenc train``: continued pretraining of a (patched) model with accelerate.

The flags are added in named steps, one argument group each (:data:`ARGUMENT_STEPS`, in the order
``--help`` lists them); a new training option adds its flags in a step of its own (or in the
group it belongs to) and its field to :class:`~hf_posenc.recipes.training.config.TrainConfig`.
Every flag whose destination is a ``TrainConfig`` field can also come from ``--config FILE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from ..training.config import TrainConfig
from .common import (
    TRACKERS,
    add_encoding_arguments,
    add_run_option,
    add_threads_argument,
    given_flags,
    merge_settings,
    parse_encoding_params,
    refuse_ignored_flags,
    refuse_unread_source_options,
)
from .long_context import add_long_context_arguments

#: TrainConfig's defaults, shown by --help (model and output_dir have none: they must be given)
DEFAULTS = TrainConfig(model="-", output_dir="-")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What to train and where: the model, the output folder, the encoding, a settings file."""
    group = parser.add_argument_group("model and run")
    add_run_option(
        group,
        "config",
        help="YAML/JSON of train settings (TrainConfig's fields, at the top level or under 'train:'; "
        "e.g. a run's train_config.json); flags given here override it",
    )
    group.add_argument("--model", default=None, help="hub id or local directory of the checkpoint (required)")
    add_run_option(
        group, "output_dir", default=None, help="checkpoints and the final model go here (required)"
    )
    add_encoding_arguments(group)
    add_run_option(
        group,
        "dry_run",
        help="check every input, print the resolved settings (usable as --config) and stop; loads no model "
        "and no data",
    )


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the training text comes from and how it is cut into sequences."""
    group = parser.add_argument_group("data")
    add_run_option(
        group,
        "data",
        default=DEFAULTS.data,
        help="local files/dirs/globs (.txt, .jsonl), hf:NAME[:CONFIG], or builtin:stdlib",
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id; default: the model's")
    add_run_option(group, "text_field", default=DEFAULTS.text_field, help="text column of .jsonl/hub data")
    group.add_argument("--split", default=DEFAULTS.split, help="split of hub data")
    add_run_option(group, "max_documents", help="cap on training documents; default: all")
    group.add_argument(
        "--seq-len",
        "--train-length",
        dest="seq_len",
        type=int,
        default=DEFAULTS.seq_len,
        help="packed sequence length (tokens)",
    )
    group.add_argument(
        "--data-cache",
        default=None,
        metavar="DIR",
        help="tokenised data cache; default: OUTPUT_DIR/data-cache",
    )
    group.add_argument(
        "--num-proc", type=int, default=None, help="tokenisation worker processes; default: one"
    )


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch, schedule and optimiser."""
    group = parser.add_argument_group("batch, schedule and optimiser")
    add_run_option(group, "batch_size", default=DEFAULTS.batch_size, help="sequences per process")
    group.add_argument(
        "--grad-accum", type=int, default=DEFAULTS.grad_accum, help="micro-batches per optimizer step"
    )
    group.add_argument("--max-steps", type=int, default=DEFAULTS.max_steps, help="optimizer steps")
    add_run_option(group, "lr", default=DEFAULTS.lr, help="peak learning rate (AdamW)")
    group.add_argument(
        "--encoding-lr",
        type=float,
        default=None,
        help="learning rate of the encoding's own parameters; default: --lr",
    )
    group.add_argument(
        "--end-lr-ratio",
        type=float,
        default=DEFAULTS.end_lr_ratio,
        help="final learning rate as a fraction of --lr (cosine decay)",
    )
    group.add_argument(
        "--warmup-ratio",
        type=float,
        default=DEFAULTS.warmup_ratio,
        help="fraction of the steps spent warming up linearly",
    )
    group.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay, help="AdamW weight decay")
    group.add_argument(
        "--max-grad-norm",
        type=float,
        default=DEFAULTS.max_grad_norm,
        help="gradient clipping norm (0: no clipping)",
    )
    add_run_option(group, "seed", default=DEFAULTS.seed)


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """Number formats and memory."""
    group = parser.add_argument_group("precision, memory and threads")
    group.add_argument(
        "--dtype",
        default=DEFAULTS.dtype,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the weights",
    )
    group.add_argument(
        "--mixed-precision",
        default=DEFAULTS.mixed_precision,
        choices=["no", "bf16", "fp16"],
        help="accelerate's autocast",
    )
    group.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in the backward pass"
    )
    add_threads_argument(group)


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, resuming and replacing a run."""
    group = parser.add_argument_group("checkpoints")
    group.add_argument(
        "--save-every",
        type=int,
        default=DEFAULTS.save_every,
        help="checkpoint every N steps (0: only final/)",
    )
    group.add_argument(
        "--keep-checkpoints", type=int, default=DEFAULTS.keep_checkpoints, help="newest checkpoints kept"
    )
    group.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint")
    add_run_option(
        group,
        "overwrite",
        help="replace the run (checkpoints, final/) already in --output-dir",
    )


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """Logging and trackers."""
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-every", type=int, default=DEFAULTS.log_every, help="print and log the loss every N steps"
    )
    add_run_option(group, "report_to", help=f"accelerate trackers: {TRACKERS}")


def add_validation_arguments(parser: argparse.ArgumentParser) -> None:
    """Held-out loss during training."""
    group = parser.add_argument_group("validation")
    group.add_argument(
        "--eval-every",
        type=int,
        default=DEFAULTS.eval_every,
        metavar="N",
        help="held-out loss every N steps and at the end, printed, logged to the --report-to trackers as "
        "eval_loss and written to OUTPUT_DIR/eval_losses.json (0: never)",
    )
    add_run_option(
        group,
        "eval_data",
        help="held-out text (as --data); default: the --eval-split of --data (builtin:stdlib, hf:NAME only)",
    )
    add_run_option(group, "eval_split", default=DEFAULTS.eval_split, help="split of --data held out")
    add_run_option(
        group, "eval_tokens", default=DEFAULTS.eval_tokens, help="held-out tokens each evaluation reads"
    )


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Several processes (``accelerate launch``)."""
    group = parser.add_argument_group("several processes (accelerate launch)")
    group.add_argument(
        "--ddp-timeout",
        type=int,
        default=DEFAULTS.ddp_timeout,
        metavar="SECONDS",
        help="how long a collective waits for the other processes before failing",
    )
    group.add_argument(
        "--context-parallel",
        type=int,
        default=DEFAULTS.context_parallel,
        metavar="N",
        help="split each sequence over N GPUs with accelerate's context parallelism (FSDP2, torch ring "
        "attention); plain causal SDPA encodings only; launch with recipes/accelerate/cp_fsdp2.yaml",
    )
    group.add_argument(
        "--sequence-parallel",
        type=int,
        default=DEFAULTS.sequence_parallel,
        metavar="N",
        help="DeepSpeed Ulysses through accelerate: every N consecutive processes split each sequence (each "
        "its seq_len/N tokens, head-parallel attention); --batch-size is per group; launch with "
        "recipes/accelerate/ulysses.yaml; needs deepspeed",
    )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA through peft."""
    group = parser.add_argument_group("LoRA (peft)")
    group.add_argument(
        "--lora", action="store_true", help="LoRA on the base weights; the encoding trains fully"
    )
    group.add_argument("--lora-r", type=int, default=DEFAULTS.lora_r, help="LoRA rank")
    group.add_argument("--lora-alpha", type=int, default=DEFAULTS.lora_alpha, help="LoRA scale numerator")
    group.add_argument("--lora-dropout", type=float, default=DEFAULTS.lora_dropout, help="LoRA dropout")
    group.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        help="module names LoRA wraps; default: the family's attention and MLP projections",
    )
    group.add_argument(
        "--lora-trainable",
        type=_comma_list,
        default=None,
        metavar="embed,norm",
        help="also train these fully beside LoRA, as LongLoRA does: embed (the input embedding), norm (every "
        "normalisation layer); through peft's modules_to_save, merged into final/",
    )


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_s2_arguments(parser: argparse.ArgumentParser) -> None:
    """LongLoRA's shifted sparse attention (S2-Attn) while training."""
    group = parser.add_argument_group("shifted sparse attention (LongLoRA)")
    group.add_argument(
        "--s2-attn",
        action="store_true",
        help="train with LongLoRA's S2-Attn (Chen et al. 2024): groups of --s2-group-size tokens, half the heads "
        "in groups shifted by half a group; evaluation and the saved model attend in full",
    )
    group.add_argument(
        "--s2-group-size",
        default=None,
        metavar="N|RATIO",
        help="tokens per group (even, dividing --seq-len) or a fraction of --seq-len such as 0.25 or 1/4; "
        "default: 1/4 (LongLoRA's)",
    )
    group.add_argument(
        "--s2-wrap",
        action="store_true",
        help="the paper's Algorithm 1 (shifted heads' tokens rolled, so the first half-group sees the last) "
        "instead of LongLoRA's unrolled groups (its flash-attention code; no token sees a later one)",
    )


#: the steps that add ``train``'s flags, in the order --help lists their groups
ARGUMENT_STEPS: list[Callable[[argparse.ArgumentParser], None]] = [
    add_run_arguments,
    add_data_arguments,
    add_optimizer_arguments,
    add_precision_arguments,
    add_checkpoint_arguments,
    add_tracking_arguments,
    add_validation_arguments,
    add_distributed_arguments,
    add_lora_arguments,
    add_s2_arguments,
    add_long_context_arguments,
]


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="continued pretraining of a patched model (accelerate; checkpoints; --resume; --lora)",
        description="Continue pretraining a causal LM after switching its positional encoding. Run it directly "
        "on one device, or under `accelerate launch` on several. Settings can come from --config FILE "
        "(YAML/JSON); flags given on the command line win.",
    )
    for add_arguments in ARGUMENT_STEPS:
        add_arguments(parser)
    parser.set_defaults(run=command_train, _parser=parser)


def _config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """TrainConfig's fields from the flags and ``--config``: the file's values except where a flag was
    given; --encoding-param keys override the file's ``encoding_params`` key by key."""
    file_values: dict[str, Any] = {}
    if args.config:
        from ..settings_file import list_fields, load_settings_file

        file_values = load_settings_file(
            args.config, allowed=_config_fields(), section="train", lists=list_fields(TrainConfig)
        )
    values = merge_settings(args, _config_fields(), file_values)
    file_params = file_values.get("encoding_params") or {}
    if not isinstance(file_params, dict):
        from ...errors import InvalidParameterError

        raise InvalidParameterError(
            f"--config {args.config!r}: encoding_params={file_params!r} is not allowed; allowed: a mapping"
        )
    values["encoding_params"] = {**file_params, **parse_encoding_params(args.encoding_param)}
    for name, flag in (("model", "--model"), ("output_dir", "--output-dir")):
        if not values.get(name):
            args._parser.error(f"{flag} is required (on the command line or in --config)")
    # flags the settings would ignore (the command line only: a dry run's settings file holds every field)
    rules = [
        (("lora_r", "lora_alpha", "lora_dropout"), bool(values.get("lora")), "without --lora", "add --lora"),
        (
            ("eval_data", "eval_split", "eval_tokens"),
            bool(values.get("eval_every")),
            "without --eval-every",
            "add --eval-every N",
        ),
    ]
    given = given_flags(args)
    refuse_ignored_flags("train", given, rules)
    refuse_unread_source_options(given, values.get("data"), values.get("eval_data"))
    return values


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**resolve_settings(args))


def print_dry_run(config: TrainConfig, args: argparse.Namespace) -> None:
    """The resolved settings as JSON on stdout (save them and pass them to --config), notes on stderr."""
    print("hf-posenc train: dry run: every input is valid; no model or data loaded.", file=sys.stderr)
    print("resolved settings (usable as --config FILE):", file=sys.stderr)
    print(json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True))
    flags = [name for name in ("resume", "overwrite") if getattr(args, name)]
    if flags:
        print(f"with: {', '.join('--' + f for f in flags)}", file=sys.stderr)


def command_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from ..training.config import preflight

    preflight(config)  # before accelerate and the model load
    if args.dry_run:
        print_dry_run(config, args)
        return 0
    from ..training import train

    result = train(config, resume=args.resume, overwrite=args.overwrite)
    if result.is_main_process:
        print(f"final model: {result.final_dir}  (reload with hf_posenc.from_pretrained)")
    return 0
