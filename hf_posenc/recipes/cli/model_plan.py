"""How the evaluation commands (``perplexity``, ``longeval``, ``lm-eval``'s recipes) take a saved
model: its folder checked, how it is evaluated (its encoding, parameters and overrides of a saved
checkpoint's parameters, and whether every evaluation length fits its position limit), its row
label, and which models share a tokenizer. All before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ...errors import PositionRangeError
from ..evaluation.errors import EvaluationError
from ..evaluation.labels import encoding_label

DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(directory: str) -> Path:
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {directory!r} does not exist (or is not a directory)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {directory!r} has no config.json (not a saved transformers model)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {directory!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
            "save one next to the model with tokenizer.save_pretrained(directory)"
        )
    return path


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one model will be evaluated: its encoding (``native`` for none), the parameters it is
    evaluated with, and the overrides of a saved checkpoint's parameters (evaluation only)."""

    encoding: str
    params: dict[str, Any] | None
    eval_overrides: dict[str, Any] | None

    @property
    def label(self) -> str:
        return encoding_label(self.encoding, self.eval_overrides)


def plan_model(
    directory: str,
    encoding: str | None,
    params: dict[str, Any],
    longest: int,
    shorten: str = "--multiples / --train-length",
) -> Plan:
    """How a model will be evaluated; fails early on a conflict, a bad override or a too-short limit
    (``shorten``: the flags the error message suggests lowering)."""
    from transformers import AutoConfig

    from ...core.loading import extension_of
    from ...core.plan import check_planned_parts
    from ...core.registry import adapter_for_config, get_encoding
    from ...core.request import (
        canonical_request,
        check_overrides,
        matches_saved,
        plan_request,
        plan_saved,
        saved_description,
    )

    config = AutoConfig.from_pretrained(directory)
    saved = getattr(config, "posenc", None)
    overrides: dict[str, Any] | None = None
    name: str | None
    if saved:
        name = saved_description(saved)
        extension = extension_of(encoding, saved)
        if extension is not None:  # e.g. selfextend on a rope run: no training, the run's RoPE settings
            config_class = get_encoding(extension).config_class
            shared = set(config_class.parameter_names())
            carried = {k: v for k, v in dict(saved.get("params") or {}).items() if k in shared}
            config_class.from_params({**carried, **params})  # bad values: one line, nothing loaded
            return Plan(extension, {**carried, **params}, dict(params))
        if encoding is not None and not matches_saved(encoding, saved):
            raise EvaluationError(
                f"{directory!r} was saved with encoding {name!r}; cannot evaluate it as {encoding!r} "
                "(point --model at the original checkpoint to switch encodings, or drop --encoding)"
            )
        if params:  # inference-time overrides, e.g. position interpolation (hf_posenc.reconfigure)
            check_overrides(saved, params, where=repr(directory))
            overrides = dict(params)
        resolved = {**dict(saved.get("params") or {}), **dict(params)}
    elif encoding is None and params:
        raise EvaluationError(
            f"--encoding-param {sorted(params)}: {directory!r} is a plain checkpoint (not saved from a patched "
            "model), so there is no encoding to override; add --encoding NAME to patch it"
        )
    else:
        name, resolved = (canonical_request(encoding) if encoding else None), params
    adapter = adapter_for_config(config)
    if name is not None and adapter is not None:
        geometry = adapter.geometry(config)
        plan = (
            plan_saved(saved, overrides, geometry.num_layers)
            if saved
            else plan_request(encoding, geometry.num_layers, resolved)
        )
        # e.g. a scaling past the dtype: one line, nothing loaded (a fresh patch: its initial values too)
        check_planned_parts(plan, geometry, initial_values=not saved)
        limit = plan.position_limit(geometry)
        if limit is not None and longest > limit.tokens:
            raise PositionRangeError(
                f"{directory!r}: evaluation length {longest} is longer than {limit.what} ({limit.setting}) "
                f"covers ({limit.tokens} positions at this scaling); lower {shorten} to at most {limit.tokens} "
                "tokens"
            )
    native_limit = adapter.native_position_limit(config) if name is None and adapter is not None else None
    if native_limit is not None and longest > native_limit[0]:
        raise PositionRangeError(
            f"{directory!r}: evaluation length {longest} is longer than {native_limit[1].format(native_limit[0])}"
            f"; lower {shorten}, or add --encoding "
            "(e.g. alibi) to patch it with an encoding that extrapolates"
        )
    return Plan(name or "native", dict(resolved) if name else None, overrides)


def model_labels(args: argparse.Namespace, plans: list[Plan], params: dict[str, Any]) -> list[str]:
    """``--labels``, or ``folder (encoding)`` per model; a row evaluated with overridden parameters says so
    (``run (expe, x0.5 at eval)``), a plain checkpoint patched with parameters shows them."""
    if args.labels is not None:
        if len(args.labels) != len(args.model):
            raise EvaluationError(
                f"--labels gives {len(args.labels)} label(s) for {len(args.model)} model(s)"
            )
        if len(set(args.labels)) != len(args.labels):
            raise EvaluationError(f"--labels {args.labels} repeat a label; give each model its own")
        return list(args.labels)
    labels: list[str] = []
    for directory, plan in zip(args.model, plans, strict=True):
        described = plan.label
        if params and plan.eval_overrides is None and plan.encoding != "native":
            described += " " + json.dumps(params, separators=(",", ":"))
        from ..evaluation.labels import run_name

        label = f"{run_name(directory)} ({described})"
        candidate, number = label, 2
        while candidate in labels:
            candidate, number = f"{label} #{number}", number + 1
        labels.append(candidate)
    return labels


def tokenizer_key(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha1(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()
