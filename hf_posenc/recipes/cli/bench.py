"""``hf-posenc bench``: each encoding's time and memory as ratios to the native model."""

from __future__ import annotations

import argparse

from ...errors import InvalidParameterError
from ...models import canonical_family, family_names
from .common import checked_device, given_flags, refuse_ignored_flags


def register(commands: argparse._SubParsersAction) -> None:
    from ..benchmark.config import BenchConfig

    defaults = BenchConfig(encodings=[])
    parser = commands.add_parser(
        "bench",
        help="time and memory of each encoding as ratios to the native model, measured in one run",
        description="Medians after warm-up; forward, forward+backward and per-token decode latency; writes "
        "bench.md, bench.json and bench.png.",
    )
    parser.add_argument(
        "--encodings", nargs="+", default=None, metavar="NAME", help="default: every encoding"
    )
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=defaults.lengths, help="sequence lengths (tokens)"
    )
    parser.add_argument(
        "--train-lengths",
        nargs="+",
        type=int,
        default=None,
        help="lengths of the train mode (default: --lengths), e.g. --lengths 4096 --train-lengths 2048",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=defaults.modes,
        choices=["forward", "train", "decode"],
        help="forward pass, forward+backward, token-by-token decoding with a cache",
    )
    parser.add_argument(
        "--family",
        default=defaults.family,
        choices=family_names(),
        type=canonical_family,
        help="model family of the random model",
    )
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="of the random model")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="of the random model")
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers, help="of the random model")
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads, help="of the random model")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per call")
    parser.add_argument(
        "--repeats", type=int, default=defaults.repeats, help="timed calls per cell (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed calls first")
    parser.add_argument(
        "--decode-prompt", type=int, default=defaults.decode_prompt, help="prompt tokens before decoding"
    )
    parser.add_argument("--decode-tokens", type=int, default=defaults.decode_tokens, help="tokens decoded")
    parser.add_argument("--device", default=defaults.device, help="cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the model",
    )
    parser.add_argument("--backend", default=defaults.backend, help="attention backend")
    parser.add_argument(
        "--freeze-encoding",
        action="store_true",
        help="train mode with the encoding's own parameters frozen (shows what learning its tables costs)",
    )
    parser.add_argument(
        "--output-dir", "--output", dest="output_dir", default="posenc-bench", help="results go here"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier run in --output-dir"
    )
    parser.set_defaults(run=command_bench, _parser=parser)


def check_bench_args(args: argparse.Namespace) -> None:
    """One-line errors for values the suite cannot measure, before any model is built."""
    for flag in ("lengths", "train_lengths"):
        bad = [n for n in getattr(args, flag, None) or [] if n < 2]
        if bad:
            raise InvalidParameterError(
                f"--{flag.replace('_', '-')} {bad[0]} is not allowed; allowed: integers >= 2"
            )
    for flag in ("repeats", "decode_prompt", "decode_tokens", "batch_size", "num_layers", "num_heads"):
        value = getattr(args, flag)
        if value < 1:
            raise InvalidParameterError(f"--{flag.replace('_', '-')} {value} is not allowed; allowed: >= 1")
    if args.warmup < 0:
        raise InvalidParameterError(f"--warmup {args.warmup} is not allowed; allowed: >= 0")

    from ...attention import BACKENDS

    if args.backend not in BACKENDS:
        raise InvalidParameterError(
            f"--backend {args.backend!r} is not allowed; allowed: {', '.join(BACKENDS)}"
        )
    checked_device(args.device)
    rules = [  # flags the chosen modes would ignore
        (
            ("train_lengths", "freeze_encoding"),
            "train" in args.modes,
            "without the train mode",
            "add train to --modes",
        ),
        (
            ("decode_prompt", "decode_tokens"),
            "decode" in args.modes,
            "without the decode mode",
            "add decode to --modes",
        ),
    ]
    refuse_ignored_flags("", given_flags(args), rules)


def command_bench(args: argparse.Namespace) -> int:
    from ...core.registry import canonical_name, list_encodings
    from .. import run_lock
    from ..benchmark import BenchConfig, ratio_table, run_suite, write_results
    from ..benchmark.model_check import check_model_flags, model_flags
    from ..evaluation.report import check_fresh_output

    check_bench_args(args)
    names = (
        [canonical_name(n) for n in args.encodings] if args.encodings else [i.name for i in list_encodings()]
    )
    fields = set(BenchConfig.__dataclass_fields__) - {"encodings"}
    config = BenchConfig(encodings=names, **{k: v for k, v in vars(args).items() if k in fields})
    check_model_flags(config.family, names, **model_flags(args), max_positions=config.longest)
    output = check_fresh_output(args.output_dir, "bench.json", overwrite=args.overwrite, flag="--output-dir")
    with run_lock.holding(output, "bench run"):  # a second run into it: one line
        results = run_suite(config)
        paths = write_results(results, config, output)
    print(ratio_table(results))
    print(f"[bench] wrote {', '.join(str(p) for p in paths.values())}")
    return 0
