"""Checks every recipe makes before any model loads: local model folders, tokenizers, encodings
and their parameters. Each failure is one line naming the bad value and what is allowed.

Nothing here imports torch or transformers at module level, so the command line stays fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError, PosencError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def looks_local(path: str) -> bool:
    """True for what can only be a local path: ``./x``, ``/x``, ``~/x``, ``a/b/c``, or anything that exists.

    A hub id has the form ``name`` or ``owner/name``."""
    expanded = os.path.expanduser(path)
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path or os.path.exists(expanded)


def check_model_path(path: str, *, what: str = "--model", need_tokenizer: bool = False) -> dict | None:
    """For a local model folder: check it holds a saved model (and a tokenizer); return its config.json.

    A hub id is checked for what can be told at once (:func:`check_hub_id`), then left to
    transformers (returns None)."""
    if not looks_local(path):
        check_hub_id(path, what)
        return None
    folder = Path(os.path.expanduser(path))
    if not folder.exists():
        raise FileNotFoundError(
            f"{what} {path!r} does not exist; allowed: a local model folder (with config.json) or a hub id "
            "such as HuggingFaceTB/SmolLM2-135M"
        )
    if not folder.is_dir():
        raise NotADirectoryError(f"{what} {path!r} is a file; allowed: a model folder with config.json")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{what} {path!r} has no config.json: not a saved transformers model (save one with "
            "model.save_pretrained(folder))"
        )
    if need_tokenizer:
        check_tokenizer_path(path, what=what)
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidParameterError(f"{config_file} is not valid JSON ({error})") from None


#: seconds the hub reachability probe may take (transformers would retry for over a minute)
HUB_PROBE_SECONDS = 2.0


def check_hub_id(name: str, what: str = "--model", filename: str = "config.json") -> None:
    """A value that is not a local path must be a hub id that can be had: valid as a repo id, and
    in the local Hugging Face cache, or the hub reachable (not offline). Refused at once, in one
    line naming the value, where transformers would retry the hub for over a minute."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    folder = "model folder (with config.json)" if filename == "config.json" else f"folder with {filename}"
    allowed = f"allowed: a local {folder} or a hub id such as HuggingFaceTB/SmolLM2-135M"
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            f"{what} {name!r} is not a local folder (no such path) nor a valid hub id; {allowed}"
        ) from None
    if isinstance(try_to_load_from_cache(name, filename), str):
        return  # cached: transformers loads it without the network
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{what} {name!r} is not a local folder (no such path) and not in the Hugging Face cache, and the hub "
            f"is offline (HF_HUB_OFFLINE); {allowed}"
        )
    reason = _hub_unreachable(constants.ENDPOINT)
    if reason is not None:
        raise FileNotFoundError(
            f"{what} {name!r} is not a local folder (no such path) and not in the Hugging Face cache, and the hub "
            f"({constants.ENDPOINT}) cannot be reached ({reason}); {allowed}"
        )


def _hub_unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to the hub fails within :data:`HUB_PROBE_SECONDS`, or None when it opens."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return None  # behind a proxy a direct probe says nothing: leave it to transformers
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as error:
        return str(error) or type(error).__name__
    return None


def check_tokenizer_path(path: str, *, what: str = "--tokenizer") -> None:
    if not looks_local(path):
        check_hub_id(path, what, "tokenizer_config.json")
        return
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} {path!r} is not a folder; allowed: a tokenizer folder or a hub id")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{what} {path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save one next to the model "
            "with tokenizer.save_pretrained(folder), or give --tokenizer"
        )


def check_encoding(
    encoding: str | None, params: dict[str, Any] | None, saved_config: dict | None = None, *, where: str = ""
) -> str | None:
    """Validate an encoding request (name and parameters) against the registry and, for a checkpoint
    saved from a patched model, against the encoding it carries (``params`` then override its saved
    parameters), and, given its config.json (``saved_config``), what patching it would refuse that
    its config decides (a pattern longer than its depth, a scaling past the dtype). Returns the
    canonical name."""
    return check_encoding_parts(encoding, params, saved_config, where=where)[0]


def check_encoding_parts(
    encoding: str | None, params: dict[str, Any] | None, saved_config: dict | None = None, *, where: str = ""
) -> tuple[str | None, int | None]:
    """:func:`check_encoding`, and the elements of the encoding's parameters on that checkpoint
    (0: it learns nothing), from the same meta-device build of its parts; None where no
    ``saved_config`` is given or its model type is unknown."""
    canonical = _check_request(encoding, params, saved_config, where)
    elements = None if saved_config is None else _check_fits(saved_config, encoding, params, where)
    return canonical, elements


def _check_request(
    encoding: str | None, params: dict[str, Any] | None, saved_config: dict | None, where: str
) -> str | None:
    """The checks of :func:`check_encoding` that need only the registry and the saved entry."""
    from ..core.request import (
        canonical_request,
        check_request,
        check_saved_entry,
        matches_saved,
        saved_description,
    )

    prefix = f"{where}: " if where else ""
    saved = (saved_config or {}).get("posenc") or None
    if saved:
        check_saved_entry(saved, where)  # a hand-edited entry (a string, no name): one line
        if encoding is not None and not matches_saved(encoding, saved):
            raise InvalidParameterError(
                f"{prefix}the checkpoint was saved with encoding {saved_description(saved)!r}; cannot use it as "
                f"{encoding!r} (start from the original checkpoint to switch encodings, or drop --encoding)"
            )
        if params:  # overrides of inference-time parameters (hf_posenc.reconfigure checks the rest)
            from ..core.request import check_overrides

            check_overrides(saved, params, where=where)
        return saved.get("encoding")
    if encoding is None:
        if params:
            raise InvalidParameterError(f"{prefix}encoding parameters {sorted(params)} need --encoding NAME")
        return None
    check_request(encoding, params)  # a name or a per-layer pattern text (rope*3+nope)
    return canonical_request(encoding)


def _check_fits(
    saved_config: dict, encoding: str | None, params: dict[str, Any] | None, where: str
) -> int | None:
    """What patching the checkpoint of ``saved_config`` (its config.json) with ``encoding`` (or,
    for a checkpoint saved patched, its own encoding with ``params`` overriding) would refuse that
    its config decides: a pattern longer than its depth, a scaling past the dtype, a model type no
    family serves. Returns the elements of the encoding's parameters (None: not known from the
    config, or nothing to patch)."""
    from transformers import CONFIG_MAPPING

    from ..core.plan import check_patch_fits

    model_type = saved_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None  # transformers names an unknown model type when it loads the checkpoint
    try:
        fresh = None if saved_config.get("posenc") else encoding
        return check_patch_fits(CONFIG_MAPPING[model_type].from_dict(saved_config), fresh, params)
    except PosencError as error:
        if not where:
            raise
        raise type(error)(f"{where}: {error}") from None
