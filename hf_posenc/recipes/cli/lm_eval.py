"""``hf-posenc lm-eval``: lm-eval with the ``hf-posenc`` model registered, plus benchmark recipes.

Two modes:

- **passthrough** — ``hf-posenc lm-eval --model hf-posenc --model_args pretrained=DIR --tasks ...``
  (or ``hf-posenc lm-eval ls tasks``): registers the model, then runs lm-eval's own CLI on
  exactly these arguments;
- **recipe** — any of ``--preset``, ``--pretrained``, ``--data-dir``, ``--mmlu-subjects``,
  ``--output``: HellaSwag, MMLU, ARC-Easy and ARC-Challenge with each task's own shot count,
  on the hub datasets or on local files, for one or several checkpoints, with one comparison
  table. All inputs are checked before any model is loaded.

This module holds the command, its options and the passthrough; the recipe mode runs in
:mod:`.lm_eval_recipe`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..integrations.lm_eval_tasks import PRESET_NOTES, PRESETS, SUPPORTED_TASKS, BenchmarkError
from .common import DefaultsRawDescriptionHelpFormatter

LM_EVAL_COMMANDS = ("run", "ls", "validate")
RECIPE_FLAGS = ("preset", "pretrained", "data_dir", "mmlu_subjects", "output")
DESCRIPTION = """\
lm-eval with the hf-posenc model registered. Two modes:
  passthrough: no recipe option below; the arguments go to lm-eval's own CLI (--model defaults
    to hf-posenc), e.g.
    hf-posenc lm-eval --model hf-posenc --model_args pretrained=DIR[,encoding=NAME,...] --tasks ...
  recipe: any recipe option; HellaSwag, MMLU, ARC-Easy, ARC-Challenge with each task's shot
    count, on the hub datasets or local files, for one or more checkpoints, one comparison table.
"""
EPILOG = f"""\
presets: {"; ".join(f"{name}: {note}" for name, note in PRESET_NOTES.items())}

local data (--data-dir DIR), rows in the hub datasets' schemas, .jsonl (or a .json array):
  DIR/hellaswag/validation.jsonl  [train.jsonl for few-shot]               Rowan/hellaswag
  DIR/arc_easy/test.jsonl  [train.jsonl for few-shot; validation.jsonl]    allenai/ai2_arc
  DIR/arc_challenge/...    (same files)
  DIR/mmlu/<subject>/test.jsonl  [dev.jsonl for few-shot; validation.jsonl]  cais/mmlu

examples:
  hf-posenc lm-eval --preset paper --pretrained ckpt-rope ckpt-expe --output results/
  hf-posenc lm-eval --preset leaderboard --model_args pretrained=ckpt,encoding=alibi --device cuda
  hf-posenc lm-eval --tasks arc_easy --data-dir data/ --pretrained ckpt --limit 100
  hf-posenc lm-eval --model hf-posenc --model_args pretrained=ckpt --tasks lambada_openai   (passthrough)
  hf-posenc lm-eval run --help                                     (all of lm-eval's options)
"""


class _RawArgsParser(argparse.ArgumentParser):
    """A subcommand parser that keeps its arguments verbatim (they are lm-eval's, parsed later)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.lm_eval_argv = list(sys.argv[2:] if args is None else args)
        namespace.run = command_lm_eval
        return namespace, []


def _recipe_parser(lm_eval_options: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-posenc lm-eval",
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,
        add_help=False,
        formatter_class=DefaultsRawDescriptionHelpFormatter,
    )
    recipe = parser.add_argument_group("recipe options")
    recipe.add_argument(
        "--preset", help=f"one of {', '.join(PRESETS)} (default tasks: {' '.join(SUPPORTED_TASKS)})"
    )
    recipe.add_argument(
        "--pretrained", nargs="+", metavar="DIR", help="checkpoints to compare, one column each"
    )
    recipe.add_argument(
        "--data-dir", metavar="DIR", help="run the packaged tasks on local files (layout below)"
    )
    recipe.add_argument("--mmlu-subjects", nargs="+", metavar="SUBJECT", help="MMLU subset (default: all)")
    recipe.add_argument(
        "--output-dir",
        "--output",
        dest="output",
        metavar="DIR",
        help="write lm-eval's results JSON and the table here",
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    parser.add_argument("-h", "--help", action="store_true", help="show this help")
    if lm_eval_options:
        lm = parser.add_argument_group("lm-eval options accepted with a recipe")
        lm.add_argument("--model", default="hf-posenc", help="lm-eval model name (default: hf-posenc)")
        lm.add_argument(
            "--model_args",
            nargs="+",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="one model per use; without pretrained= they apply to every --pretrained checkpoint",
        )
        lm.add_argument("--output_path", dest="output", metavar="DIR", help="same as --output")
        lm.add_argument("--tasks", nargs="+", metavar="TASK", help=f"subset of {', '.join(SUPPORTED_TASKS)}")
        lm.add_argument("--num_fewshot", type=int, help="shots for every task (not with --preset)")
        lm.add_argument("--limit", type=float, help="examples per task (a count, or a fraction < 1)")
        lm.add_argument("--batch_size", default="1", help="an integer, 'auto' or 'auto:N'")
        lm.add_argument("--max_batch_size", type=int, help="upper bound for --batch_size auto")
        lm.add_argument("--device", help="cpu, cuda, cuda:0, mps, ...")
        lm.add_argument("--seed", type=int, help="one seed for python, numpy, torch and few-shot sampling")
        lm.add_argument(
            "--log_samples", action="store_true", help="also write per-sample outputs (needs --output)"
        )
        retrieval = parser.add_argument_group("retrieval tasks (--tasks passkey_4096 niah_single_2048 ...)")
        retrieval.add_argument(
            "--depths",
            type=float,
            nargs="+",
            default=None,
            metavar="D",
            help="needle depths (default 0 .25 .5 .75 1)",
        )
        retrieval.add_argument("--samples", type=int, default=20, help="samples per task, length and depth")
    return parser


def _with_default_model(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--model hf-posenc`` added to an evaluation run that names no model or config.

    lm-eval's own default, ``hf``, would load a patched checkpoint without its encoding."""
    argv = list(argv)
    if not argv or argv[0] in ("ls", "validate"):
        return argv
    prefix, body = (argv[:1], argv[1:]) if argv[0] == "run" else ([], argv)
    explicit = ("--model", "-M", "--config", "-C", "-h", "--help")
    if not body or any(a in explicit or a.startswith(("--model=", "--config=")) for a in body):
        return argv
    return [*prefix, "--model", "hf-posenc", *body]


def _option_values(argv: Sequence[str], names: tuple[str, ...]) -> list[str]:
    """The values given to any of ``names`` (``--name VALUE ...`` or ``--name=VALUE``)."""
    values: list[str] = []
    for index, token in enumerate(argv):
        for name in names:
            if token.startswith(name + "="):
                values.append(token[len(name) + 1 :])
            elif token == name:
                following = []
                for item in argv[index + 1 :]:
                    if item.startswith("-"):
                        break
                    following.append(item)
                values.append(",".join(following))
    return values


def check_passthrough_model(argv: Sequence[str]) -> None:
    """Before lm-eval imports and indexes its tasks (tens of seconds): the hf-posenc model's
    checkpoint folder, tokenizer and encoding name (the parameters are checked when it loads)."""
    argv = _with_default_model(argv)
    models = _option_values(argv, ("--model", "-M"))
    if not models or models[-1] != "hf-posenc":
        return
    from ..preflight import check_model_path

    for text in _option_values(argv, ("--model_args", "-a")):
        if text.lstrip().startswith("{"):
            try:
                args = json.loads(text)
            except json.JSONDecodeError as error:
                raise BenchmarkError(f"--model_args {text!r} is not valid JSON ({error})") from None
        else:
            args = dict(item.partition("=")[::2] for item in text.split(",") if item)
        pretrained = str(args.get("pretrained") or "")
        if not pretrained:
            raise BenchmarkError(
                f"--model_args {text!r} has no pretrained=DIR (a checkpoint folder or hub id)"
            )
        saved = check_model_path(
            os.path.expanduser(pretrained), what="pretrained", need_tokenizer="tokenizer" not in args
        )
        encoding = args.get("encoding")
        if encoding and not (saved or {}).get("posenc"):
            from ...core.request import canonical_request

            canonical_request(str(encoding))


def run_lm_eval_cli(argv: Sequence[str]) -> int:
    """lm-eval's own command line on ``argv`` (model default ``hf-posenc``), with the model registered."""
    from lm_eval.__main__ import cli_evaluate

    from ..integrations import lm_eval_model  # registers the model

    lm_eval_model.quiet_git_probe()
    saved = sys.argv
    sys.argv = ["lm-eval", *_with_default_model(argv)]
    try:
        cli_evaluate()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _asks_retrieval(argv: Sequence[str]) -> bool:
    """Whether ``--tasks`` names a generated retrieval task (``passkey_4096``): run as a recipe."""
    from ..integrations.lm_eval_longeval import parse_task_name

    names = [t for text in _option_values(argv, ("--tasks", "-t")) for t in text.split(",") if t]
    return any(parse_task_name(name) is not None for name in names)


def command_lm_eval(args: argparse.Namespace) -> int:
    argv = list(args.lm_eval_argv)
    if "--traceback" in argv:
        args.traceback = True
        argv.remove("--traceback")
    if argv and argv[0] in LM_EVAL_COMMANDS:
        return run_lm_eval_cli(argv)
    first, _ = _recipe_parser(lm_eval_options=False).parse_known_args(argv)
    if not argv or first.help:
        _recipe_parser(lm_eval_options=True).print_help()
        return 0 if argv else 2
    if not any(getattr(first, flag) for flag in RECIPE_FLAGS) and not _asks_retrieval(argv):
        check_passthrough_model(argv)
        return run_lm_eval_cli(argv)
    opts, rest = _recipe_parser(lm_eval_options=True).parse_known_args(argv)
    if rest:
        raise BenchmarkError(
            f"unsupported with a recipe (--preset/--pretrained/--data-dir/--mmlu-subjects/--output): "
            f"{' '.join(rest)}; see `hf-posenc lm-eval --help`, or drop the recipe options to pass "
            "everything to lm-eval unchanged"
        )
    from .lm_eval_recipe import run_recipe

    return run_recipe(opts)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "lm-eval",
        help="run lm-eval with the hf-posenc model (passthrough) or a benchmark preset",
        add_help=False,
    )
    parser.__class__ = _RawArgsParser  # its arguments are parsed by command_lm_eval
    parser.set_defaults(run=command_lm_eval)
