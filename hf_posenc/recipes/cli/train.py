"""``hf-posenc train``: continued pretraining of a (patched) model with accelerate."""

from __future__ import annotations

import argparse
import dataclasses

from ..training.config import TrainConfig
from .common import add_encoding_arguments, parse_encoding_params


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="continued pretraining of a patched model (accelerate; checkpoints; --resume; --lora)",
        description="Continue pretraining a causal LM after switching its positional encoding. Run it directly "
        "on one device, or under `accelerate launch` on several.",
    )
    defaults = TrainConfig(model="-", output_dir="-")
    parser.add_argument("--model", required=True, help="hub id or local directory of the checkpoint")
    parser.add_argument(
        "--output-dir",
        "--output",
        dest="output_dir",
        required=True,
        help="checkpoints and the final model go here",
    )
    add_encoding_arguments(parser)
    parser.add_argument(
        "--data",
        nargs="+",
        default=defaults.data,
        metavar="SRC",
        help="local files/dirs/globs (.txt, .jsonl), hf:NAME[:CONFIG], or builtin:stdlib",
    )
    parser.add_argument("--tokenizer", default=None, help="default: the model's")
    parser.add_argument("--text-field", default=defaults.text_field)
    parser.add_argument("--split", default=defaults.split)
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument(
        "--seq-len",
        "--train-length",
        dest="seq_len",
        type=int,
        default=defaults.seq_len,
        help="packed sequence length",
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per process")
    parser.add_argument("--grad-accum", type=int, default=defaults.grad_accum)
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--encoding-lr", type=float, default=None, help="lr of the encoding's own parameters")
    parser.add_argument("--end-lr-ratio", type=float, default=defaults.end_lr_ratio)
    parser.add_argument("--warmup-ratio", type=float, default=defaults.warmup_ratio)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm)
    parser.add_argument(
        "--save-every", type=int, default=defaults.save_every, help="checkpoint every N steps"
    )
    parser.add_argument("--keep-checkpoints", type=int, default=defaults.keep_checkpoints)
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--mixed-precision", default=defaults.mixed_precision, choices=["no", "bf16", "fp16"])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run (checkpoints, final/) already in --output-dir",
    )
    parser.add_argument(
        "--ddp-timeout",
        type=int,
        default=defaults.ddp_timeout,
        metavar="SECONDS",
        help="how long a collective waits for the other processes before failing (default: %(default)s)",
    )
    parser.add_argument(
        "--report-to",
        nargs="+",
        default=[],
        metavar="TRACKER",
        help="accelerate trackers: tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, all",
    )
    parser.add_argument(
        "--data-cache",
        default=None,
        metavar="DIR",
        help="tokenised data cache (default: OUTPUT_DIR/data-cache)",
    )
    parser.add_argument("--num-proc", type=int, default=None, help="tokenisation worker processes")
    parser.add_argument(
        "--lora", action="store_true", help="LoRA on the base weights; the encoding trains fully"
    )
    parser.add_argument("--lora-r", type=int, default=defaults.lora_r)
    parser.add_argument("--lora-alpha", type=int, default=defaults.lora_alpha)
    parser.add_argument("--lora-dropout", type=float, default=defaults.lora_dropout)
    parser.add_argument("--lora-targets", nargs="+", default=None)
    parser.set_defaults(run=command_train)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    values["encoding_params"] = parse_encoding_params(args.encoding_param)
    return TrainConfig(**values)


def command_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from ..training import train
    from ..training.loop import preflight

    preflight(config)  # before accelerate, torch and the model load
    result = train(config, resume=args.resume, overwrite=args.overwrite)
    if result.is_main_process:
        print(f"final model: {result.final_dir}  (reload with hf_posenc.from_pretrained)")
    return 0
