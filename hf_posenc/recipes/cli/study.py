"""``hf-posenc study``: the extrapolation study (the main job); offline by default."""

from __future__ import annotations

import argparse
import dataclasses

from ..study import StudyConfig, load_study_config, run_study


def _defaults() -> argparse.Namespace:
    values = {}
    for field in dataclasses.fields(StudyConfig):
        if field.default is not dataclasses.MISSING:
            values[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            values[field.name] = field.default_factory()
    return argparse.Namespace(**values)


def register(commands: argparse._SubParsersAction) -> None:
    defaults = _defaults()  # no StudyConfig(): validating its encodings would import the engine
    parser = commands.add_parser(
        "study",
        help="patch a base model with each encoding, continue pretraining, report loss vs length",
        description="With no arguments: an offline study on the Python standard library's sources, with a tiny "
        "Llama first pretrained with RoPE, switched to rope, alibi, t5, nope, sinusoidal, expe and exqpe, "
        "plus evaluation-only rows: expe/exqpe at scaling factor 2 (the ExPE paper's Table 3) and RoPE with "
        "position interpolation (about 10-15 minutes on 2 CPU cores).",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML/JSON of study settings (e.g. a previous study_config.json); flags given here override it",
    )
    parser.add_argument("--output-dir", "--output", dest="output_dir", default=defaults.output_dir)
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
    parser.add_argument("--data", nargs="+", default=defaults.data, metavar="SRC")
    parser.add_argument(
        "--eval-data", nargs="+", default=None, metavar="SRC", help="default: the --eval-split of --data"
    )
    parser.add_argument("--train-split", default=defaults.train_split)
    parser.add_argument("--eval-split", default=defaults.eval_split)
    parser.add_argument("--text-field", default=defaults.text_field)
    parser.add_argument("--max-documents", type=int, default=None, help="cap on training documents")
    parser.add_argument(
        "--train-length", "--seq-len", dest="train_length", type=int, default=defaults.train_length
    )
    parser.add_argument("--multiples", nargs="+", type=int, default=defaults.multiples)
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help="continued-pretraining steps per encoding"
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=defaults.pretrain_steps,
        help="steps of RoPE pretraining of the embedded base model",
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--eval-tokens", type=int, default=defaults.eval_tokens, help="tokens evaluated at every length"
    )
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--eval-only",
        nargs="*",
        default=None,
        metavar="ROW",
        help="rows evaluated without training: TRAINED@{JSON overrides} or TRAINED@interpolate (factor = "
        "length / train length), TRAINED one of --encodings (default: expe and exqpe at scaling factor 2, "
        "rope@interpolate; give --eval-only alone for none)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="retrain runs whose recorded settings differ (else: an error)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check every input and print the plan; load and train nothing"
    )
    parser.set_defaults(run=command_study, _parser=parser)


def command_study(args: argparse.Namespace) -> int:
    fields = {f for f in StudyConfig.__dataclass_fields__}
    values = {k: v for k, v in vars(args).items() if k in fields}
    if args.config:
        parser: argparse.ArgumentParser = args._parser
        given = {k for k in fields if getattr(args, k) != parser.get_default(k)}
        values = {**values, **{k: v for k, v in load_study_config(args.config).items() if k not in given}}
    run_study(StudyConfig(**values), overwrite=args.overwrite, dry_run=args.dry_run)
    return 0
