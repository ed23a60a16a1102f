"""``hf-posenc export CKPT OUT``: a checkpoint saved from a patched model as a plain transformers
checkpoint (no ``posenc`` entry; vLLM, SGLang and TGI load it), where an exactly equivalent
native configuration exists (:func:`hf_posenc.export_native`); the tokenizer comes along."""

from __future__ import annotations

import argparse
from pathlib import Path


def command_export(args: argparse.Namespace) -> int:
    from ...core.export import check_target, export_native
    from ...core.loading import from_pretrained

    out = check_target(args.out)  # before anything loads
    source = Path(args.checkpoint)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"export: {args.checkpoint!r} is not a checkpoint folder (no config.json)")
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from ...core.export import ExportError

    hf_logging.disable_progress_bar()  # the outcome is one line: exported, or why not

    if not getattr(AutoConfig.from_pretrained(str(source)), "posenc", None):
        raise ExportError(
            f"export: {args.checkpoint!r} was not saved from a patched model: it already is a plain "
            "transformers checkpoint (nothing to export)"
        )
    model = from_pretrained(str(source))
    export_native(model, out)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError):
        tokenizer = None  # a checkpoint saved without its tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    print(
        f"exported {args.checkpoint} to {out}: a plain transformers checkpoint (AutoModelForCausalLM loads it)"
    )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="write a patched checkpoint as a plain transformers one, where a native equivalent exists",
        description="Write CKPT (saved from a patched model) to OUT as a plain transformers checkpoint with "
        "the same logits (checked): the family's RoPE with no or a static scaling, RoPE/NoPE per layer on a "
        "family with per-layer NoPE, GPT-2's position table (README: Export). Anything else is refused in one line, and OUT must be new or empty.",
    )
    parser.add_argument("checkpoint", metavar="CKPT", help="folder saved from a patched model")
    parser.add_argument("out", metavar="OUT", help="new or empty folder to write")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    parser.set_defaults(run=command_export)
