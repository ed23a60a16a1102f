"""The benchmarks' model flags (and the study's embedded base) checked before any model is
built: one line for a shape the family cannot build (or its native model cannot run) and for an
encoding that cannot patch it, instead of a traceback from transformers, or an error after other
rows were measured.

Everything is decided from the model's config and a build on the meta device (no memory, no
initialisation, no weights): transformers validates the config (RoPE's even width, heads
dividing the hidden size in most families), the modules check what the config does not (GPT-2's
heads), and :func:`hf_posenc.core.plan.check_patch_fits` runs each encoding's own checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from ...errors import InvalidParameterError, PosencError


def check_model_flags(
    family: str,
    encodings: Iterable[str],
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    max_positions: int = 2048,
    named: str | None = None,
) -> Any:
    """Raise a one-line :class:`~hf_posenc.errors.PosencError` naming the flags (an unknown
    family: :class:`~hf_posenc.errors.UnsupportedModelError`) unless ``tiny_model(family, ...)``
    builds with these flags, its native positions can run at its head width, and every encoding
    in ``encodings`` can patch it. ``num_kv_heads`` None: as many as ``num_heads``; ``named``: how
    the errors name the model (default: its ``--family``, ``--hidden-size`` and ``--num-heads``).
    Returns the model's config (for checks of encodings with parameters: ``check_patch_fits``)."""
    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_heads if num_kv_heads is None else num_kv_heads,
    }
    for name, value in sizes.items():
        if value < 1:
            raise InvalidParameterError(f"--{name.replace('_', '-')} {value} is not allowed; allowed: >= 1")
    if num_heads % sizes["num_kv_heads"]:
        raise InvalidParameterError(
            f"--num-kv-heads {sizes['num_kv_heads']} is not allowed with --num-heads {num_heads}; allowed: "
            f"a divisor of {num_heads}"
        )
    shape = named or f"--family {family} --hidden-size {hidden_size} --num-heads {num_heads}"
    config = _built_config(family, shape, max_positions=max_positions, **sizes)

    from ...core.plan import check_patch_fits
    from ...core.registry import adapter_for_config

    adapter = adapter_for_config(config)
    assert adapter is not None  # (built from the family's own adapter)
    geometry = adapter.geometry(config)
    rotated = int(geometry.head_dim * geometry.partial_rotary_factor)
    native_rotary = geometry.rotary_positions and any(
        geometry.layer(i).native_rotary for i in range(geometry.num_layers)
    )
    if native_rotary and (rotated < 2 or rotated % 2):  # (some families leave it to the rotation to fail)
        raise InvalidParameterError(
            f"{shape}: the native model's rotary dimension head_dim * partial_rotary_factor = "
            f"{geometry.head_dim} * {geometry.partial_rotary_factor} -> {rotated} is not allowed; allowed: "
            "an even number >= 2 (rotations act on pairs of dimensions)"
        )
    for name in encodings:
        try:
            check_patch_fits(config, name)
        except PosencError as error:
            raise type(error)(f"{shape}: {error}") from None
    return config


def _built_config(family: str, shape: str, **arguments: int) -> Any:
    """The config of ``tiny_model(family, **arguments)``, its model built once on the meta device;
    any failure of either as one line (``shape``: the flags it names)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...core.registry import get_family
    from ..tiny import tiny_config

    get_family(family)  # an unknown family: its own line (with a did-you-mean)
    try:
        config = tiny_config(family, **arguments)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as error:  # transformers' validators wrap the reason (a ValueError) in their own
        reason = str(error.__cause__ or error).strip().splitlines()[0]
        raise InvalidParameterError(f"{shape}: not a model {family} can build: {reason}") from None
    return config


def model_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The shape flags of a benchmark's options, as :func:`check_model_flags` takes them
    (``num_kv_heads`` None where it has no ``--num-kv-heads``)."""
    names = ("vocab_size", "hidden_size", "num_layers", "num_heads")
    return {
        **{name: getattr(args, name) for name in names},
        "num_kv_heads": getattr(args, "num_kv_heads", None),
    }


def check_model_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, encodings: Iterable[str], max_positions: int
) -> None:
    """:func:`check_model_flags` for a benchmark module's options (``--family`` and
    :func:`model_flags`), and its ``--device`` where it has one (``checked_device``), a failure
    through ``parser.error`` (one line, exit status 2)."""
    from ..cli.common import checked_device

    try:
        if getattr(args, "device", None) is not None:
            checked_device(args.device)
        check_model_flags(args.family, encodings, **model_flags(args), max_positions=max_positions)
    except PosencError as error:
        parser.error(str(error))
