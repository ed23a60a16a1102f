"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from typing import Any


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that names an unknown option first, with the known ones it is
    closest to: ``--modle x`` reads "unrecognized arguments: --modle (did you mean --model?)",
    where argparse alone reports the required options still missing (``--model`` among them)
    or, for a command with none, "hf-posenc: error: unrecognized arguments" without a hint."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        unknown = self._unknown_options(args)
        if unknown:
            self.error(f"unrecognized arguments: {', '.join(map(self._with_suggestion, unknown))}")
        return super().parse_known_args(args, namespace)

    def _unknown_options(self, args: list[str]) -> list[str]:
        """The options in ``args`` that no action of this parser takes (argparse's own reading,
        abbreviations included), found by parsing with no option required."""
        actions = [action for action in self._actions if action.required]
        groups = [group for group in self._mutually_exclusive_groups if group.required]
        self._set_required(actions, groups, False)
        try:
            _, extras = super().parse_known_args(args, argparse.Namespace())
        finally:
            self._set_required(actions, groups, True)
        return [extra.split("=", 1)[0] for extra in extras if extra.startswith("-") and extra != "-"]

    @staticmethod
    def _set_required(
        actions: list[argparse.Action], groups: list[argparse._MutuallyExclusiveGroup], value: bool
    ) -> None:
        for action in actions:
            action.required = value
        for group in groups:
            group.required = value

    def _with_suggestion(self, option: str) -> str:
        known = [name for action in self._actions for name in action.option_strings]
        close = difflib.get_close_matches(option, known, n=2, cutoff=0.75)
        return f"{option} (did you mean {' or '.join(close)}?)" if close else option


def parse_encoding_params(items: list[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict; values are JSON when they parse (numbers, bools, dicts), else strings;
    a value that starts like JSON (``{``, ``[``, ``"``) but does not parse is an error naming the column."""
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(
                f"--encoding-param {item!r} is not allowed; allowed: KEY=VALUE (VALUE in JSON)"
            )
        key = key.strip()
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError as error:
            if value.lstrip().startswith(("{", "[", '"')):  # meant as JSON: say where it breaks
                raise argparse.ArgumentTypeError(
                    f"--encoding-param {key}: malformed JSON at column {error.colno}: {error.msg} "
                    f'({value!r}); allowed: JSON, e.g. {key}=\'{{"type":"linear","factor":2}}\''
                ) from None
            params[key] = value  # a plain string value
    return params


def add_encoding_arguments(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--encoding",
        default=None,
        help="encoding to patch in (see `hf-posenc list`), or a per-layer pattern repeated over the layers: "
        "names joined by '+', NAME*N for N layers in a row, e.g. 'rope*3+nope' (NoPE every 4th layer); "
        "--encoding-param values go to every encoding of the pattern that has that parameter",
    )
    parser.add_argument(
        "--encoding-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='an encoding parameter; VALUE is JSON when it parses, e.g. scaling=\'{"type":"linear","factor":2}\'',
    )


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, as ``(default: X)``, where there is one to show:
    not for switches (off unless given), ``None`` (the help says what happens instead) or an
    empty list, nor where the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if (
            isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            or default is None
            or default is argparse.SUPPRESS
            or default == []
            or "default" in (action.help or "")
        ):
            return action.help
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{action.help or ''} (default: {shown.replace('%', '%%')})"


def given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options ``argv`` (one subcommand's arguments) sets explicitly — a flag
    given with its default value counts as given, which comparing values with defaults would miss."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(argv, argparse.Namespace())
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def given_flags(args: argparse.Namespace) -> set[str]:
    """:func:`given_on_command_line` of a subcommand's parsed ``args`` (its parser is
    ``args._parser``; none there: nothing counts as given)."""
    parser = getattr(args, "_parser", None)
    return set() if parser is None else given_on_command_line(parser, subcommand_argv(args))


def subcommand_argv(args: argparse.Namespace) -> list[str]:
    """The arguments after the subcommand's name (``main`` records the whole argv in ``args._argv``)."""
    argv = list(getattr(args, "_argv", []))
    return argv[argv.index(args.command) + 1 :] if args.command in argv else []


def merge_settings(
    args: argparse.Namespace, fields: list[str], file_values: dict[str, Any]
) -> dict[str, Any]:
    """Settings from ``args`` and a ``--config`` file: the file's values, except where the flag was
    given on the command line (flags win)."""
    parser: argparse.ArgumentParser = args._parser
    given = given_on_command_line(parser, subcommand_argv(args))
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    values.update({k: v for k, v in file_values.items() if k not in given})
    return values


class DefaultsRawDescriptionHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`DefaultsHelpFormatter` keeping the description's line breaks."""


def add_threads_argument(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads; default: OMP_NUM_THREADS if set, else 1 on a busy machine (load average >= "
        "cores), else torch's default (one per core); the choice is printed and recorded",
    )


def add_model_overrides(parser: argparse.ArgumentParser) -> None:
    """``--labels``, ``--encoding`` and ``--encoding-param`` as every evaluation recipe takes them
    (perplexity, longeval): one definition, so the recipes cannot drift apart."""
    parser.add_argument(
        "--labels", nargs="+", default=None, metavar="LABEL", help="one per model (default: dir + encoding)"
    )
    parser.add_argument(
        "--encoding", default=None, metavar="NAME", help="patch plain checkpoints with this encoding"
    )
    parser.add_argument(
        "--encoding-param",
        action="extend",
        nargs="+",
        default=[],
        metavar="K=V",
        help='encoding parameter, VALUE in JSON (e.g. scaling=\'{"type":"linear","factor":2}\'): with '
        "--encoding, patches plain checkpoints; on a saved patched checkpoint, overrides its inference-time "
        "parameters for this evaluation (position interpolation)",
    )


#: the trackers accelerate logs to (``--report-to``)
TRACKERS = "tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, all"

#: the options ``train`` and ``study`` share, each defined once: its flags and form (type, count,
#: metavar, destination); each command adds it with its own help text and default
RUN_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "config": (("--config",), {"default": None, "metavar": "FILE"}),
    "output_dir": (("--output-dir", "--output"), {"dest": "output_dir"}),
    "data": (("--data",), {"nargs": "+", "metavar": "SRC"}),
    "eval_data": (("--eval-data",), {"nargs": "+", "default": None, "metavar": "SRC"}),
    "eval_split": (("--eval-split",), {}),
    "text_field": (("--text-field",), {}),
    "max_documents": (("--max-documents",), {"type": int, "default": None}),
    "batch_size": (("--batch-size",), {"type": int}),
    "lr": (("--lr",), {"type": float}),
    "seed": (("--seed",), {"type": int, "help": "seed of data order and init"}),
    "eval_tokens": (("--eval-tokens",), {"type": int}),
    "report_to": (("--report-to",), {"nargs": "+", "default": [], "metavar": "TRACKER"}),
    "overwrite": (("--overwrite",), {"action": "store_true"}),
    "dry_run": (("--dry-run",), {"action": "store_true"}),
}


def add_run_option(parser: argparse._ActionsContainer, name: str, **wording: Any) -> None:
    """Add the shared option ``name`` (:data:`RUN_OPTIONS`) with the command's ``help`` and
    ``default``: ``train`` and ``study`` cannot drift apart in what the option accepts."""
    flags, form = RUN_OPTIONS[name]
    parser.add_argument(*flags, **{**form, **wording})


def checked_device(flag_value: str | None, *, flag: str = "--device") -> str:
    """The device a ``--device`` value names, checked before any model loads (one line for a
    string torch does not read as a device, a device type other than cpu, cuda and mps, CUDA or
    MPS on a machine without it, or a CUDA index past the machine's devices); None: ``cuda``
    where available, else ``cpu``."""
    import torch

    from ...errors import InvalidParameterError

    if flag_value is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(flag_value)
    except (RuntimeError, ValueError):
        raise InvalidParameterError(
            f"{flag} {flag_value!r} is not a device; allowed: cpu, cuda, cuda:N, mps"
        ) from None
    if device.type not in ("cpu", "cuda", "mps"):  # (torch reads more names, no model runs there)
        raise InvalidParameterError(f"{flag} {flag_value!r} is not allowed; allowed: cpu, cuda, cuda:N, mps")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidParameterError(
            f"{flag} {flag_value}: MPS is not available on this machine; use {flag} cpu"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError(
            f"{flag} {flag_value}: CUDA is not available on this machine (torch {torch.__version__}); "
            f"use {flag} cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InvalidParameterError(
            f"{flag} {flag_value}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return flag_value


#: a rule of :func:`refuse_ignored_flags`: (destinations of flags that act only when ``active``,
#: active, when they would be ignored ("without --lora"), the remedy ("add --lora"))
DependentFlags = tuple[tuple[str, ...], bool, str, str]


def refuse_ignored_flags(command: str, given: set[str], rules: Sequence[DependentFlags]) -> None:
    """One line for flags given on the command line (``given``: :func:`given_on_command_line`)
    that the run would ignore: those of a rule whose setting is not active. ``command``: the
    message's prefix (none where the command's own errors carry none)."""
    from ...errors import InvalidParameterError

    for names, active, condition, remedy in rules:
        used = ", ".join("--" + name.replace("_", "-") for name in names if name in given)
        if used and not active:
            raise InvalidParameterError(
                f"{command + ': ' if command else ''}{used} {condition} would be ignored; allowed: {remedy}, "
                f"or drop {used}"
            )


def refuse_unread_source_options(
    given: set[str],
    data: Sequence[str] | None,
    eval_data: Sequence[str] | None = None,
    *,
    split: str = "split",
) -> None:
    """The data options given on the command line (``given``) that no source of theirs reads, one
    line (:func:`~hf_posenc.recipes.data.check_source_options`): the split ``split`` (a
    destination: ``split``, ``train_split``) and ``text_field`` of ``data``, ``eval_split`` of
    ``eval_data`` (default: ``data``)."""
    from ..data import check_source_options

    if not data:
        return
    check_source_options(
        data,
        split_flag="--" + split.replace("_", "-") if split in given else None,
        text_field_flag="--text-field" if "text_field" in given else None,
    )
    if "eval_split" in given:
        check_source_options(eval_data or data, split_flag="--eval-split")
