"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_encoding_params(items: list[str] | None) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict; values are JSON when they parse (numbers, bools, dicts), else strings."""
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
        except json.JSONDecodeError:
            params[key] = value
    return params


def add_encoding_arguments(parser: argparse.ArgumentParser) -> None:
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
