"""``from_pretrained``: load a checkpoint saved from a patched model and re-apply the patch.

``save_pretrained`` on a patched model writes ``config.posenc`` (encoding name and resolved
parameters) and the encoding's tensors under the ``posenc.`` prefix. Loading builds the
model with transformers, patches it from ``config.posenc`` and loads those tensors, so
the reloaded model gives the same logits. A plain transformers load of the same folder
reports the ``posenc.*`` keys as unexpected, so the patch is never dropped silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from ..compat import ignore_unexpected_keys, resolve_checkpoint_file
from ..errors import CheckpointError, InvalidParameterError
from .patch import CONFIG_KEY, MODULE_NAME, apply_patch, patch_model
from .reconfiguration import reconfigure
from .request import check_overrides
from .saved_form import check_format_version, check_saved_entry, matches_saved, saved_description

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def _checkpoint_tensors(path: str, prefix: str, hub_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with ``prefix`` (prefix removed), from safetensors or .bin files."""
    for index_name, single_name, reader in (
        ("model.safetensors.index.json", "model.safetensors", _read_safetensors),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", _read_torch),
    ):
        index = resolve_checkpoint_file(path, index_name, **hub_kwargs)
        if index is not None:
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted({file for key, file in weight_map.items() if key.startswith(prefix)})
            paths: list[str] = []
            for file in files:
                resolved = resolve_checkpoint_file(path, file, **hub_kwargs)
                if resolved is None:
                    raise FileNotFoundError(
                        f"{path!r}: {index_name} names the shard {file!r}, which is missing"
                    )
                paths.append(resolved)
        else:
            single = resolve_checkpoint_file(path, single_name, **hub_kwargs)
            if single is None:
                continue
            paths = [single]
        tensors: dict[str, torch.Tensor] = {}
        for file in paths:
            tensors.update(reader(file, prefix))
        return tensors
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or their index) found in {path!r}")


def _read_safetensors(file: str, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return {key[len(prefix) :]: f.get_tensor(key) for key in f.keys() if key.startswith(prefix)}  # noqa: SIM118


def _read_torch(file: str, prefix: str) -> dict[str, torch.Tensor]:
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def from_pretrained(
    path: str, *model_args: Any, encoding_overrides: Mapping[str, Any] | None = None, **kwargs: Any
) -> PreTrainedModel:
    """Load a causal LM saved from a patched model and re-apply its encoding.

    ``encoding_overrides`` changes inference-time encoding parameters after loading, as
    :func:`hf_posenc.reconfigure` does (e.g. ``{"scaling": {"type": "linear", "factor": 2.0}}``);
    the learned tensors are the checkpoint's. ``kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``device_map``, ``revision``, ...).
    Raises :class:`~hf_posenc.errors.CheckpointError` if the checkpoint carries no ``posenc`` entry.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    config = kwargs.get("config") or AutoConfig.from_pretrained(path, **hub_kwargs)
    posenc = getattr(config, CONFIG_KEY, None)
    if not posenc:
        raise CheckpointError(
            f"{path!r} was not saved from a model patched by hf_posenc (its config has no 'posenc' entry); "
            "load it with transformers and call hf_posenc.patch_model(model, name)"
        )
    check_saved_entry(posenc, repr(path))
    check_format_version(posenc.get("format_version"))
    check_overrides(posenc, encoding_overrides, where=repr(path))
    model_class = cast("type[PreTrainedModel]", MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    with ignore_unexpected_keys(model_class, rf"^{MODULE_NAME}\."):
        model = AutoModelForCausalLM.from_pretrained(path, *model_args, **kwargs)
    saved = dict(getattr(model.config, CONFIG_KEY))
    check_format_version(saved.get("format_version"))
    delattr(model.config, CONFIG_KEY)
    try:
        apply_patch(model, saved, backend="auto", params={}, initialise=False)
    except BaseException:
        setattr(model.config, CONFIG_KEY, saved)
        raise
    state = _checkpoint_tensors(path, f"{MODULE_NAME}.", hub_kwargs)
    encoding = getattr(model, MODULE_NAME)
    missing = sorted(set(encoding.state_dict()) - set(state))
    if missing:
        raise CheckpointError(
            f"{path!r} names encoding {saved.get('encoding')!r} but lacks its tensors {missing}; "
            "the checkpoint is incomplete"
        )
    encoding.load_state_dict(state, strict=True)
    if encoding_overrides:
        reconfigure(model, **encoding_overrides)
    return model


def load_model(
    path: str, encoding: str | None = None, encoding_params: dict[str, Any] | None = None, **kwargs: Any
) -> PreTrainedModel:
    """Load any causal LM for the recipes: a saved patched model is re-patched from its
    ``config.posenc`` and ``encoding_params`` override its saved parameters (inference-time
    ones, as :func:`hf_posenc.reconfigure`: e.g. a position-interpolation ``scaling``);
    otherwise ``encoding`` (if given) is applied to the loaded model with ``encoding_params``.

    Asking for an encoding different from the one a checkpoint was saved with is an error, unless
    the asked one extends it without training (``EncodingConfig.extends``: ``selfextend`` on a
    checkpoint saved with ``rope``): then the saved encoding's parameters that the asked one
    shares (RoPE's theta, partial rotary, scaling) are carried over, ``encoding_params`` on top.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    hub_kwargs = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    saved = getattr(AutoConfig.from_pretrained(path, **hub_kwargs), CONFIG_KEY, None)
    if saved:
        check_saved_entry(saved, repr(path))
        extension = extension_of(encoding, saved)
        if extension is not None:
            return _load_extended(path, extension, encoding_params, **kwargs)
        if encoding is not None and not matches_saved(encoding, saved):
            raise CheckpointError(
                f"{path!r} was saved with encoding {saved_description(saved)!r}; cannot load it as {encoding!r} "
                "(load the original checkpoint to switch encodings)"
            )
        return from_pretrained(path, encoding_overrides=encoding_params, **kwargs)
    if encoding is None and encoding_params:
        raise InvalidParameterError(
            f"encoding parameters {sorted(encoding_params)} were given without an encoding name; allowed: "
            "an encoding with them, or none for a plain checkpoint"
        )
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if encoding is not None:
        patch_model(model, encoding, **(encoding_params or {}))
    return model


def extension_of(encoding: str | None, saved: Mapping[str, Any]) -> str | None:
    """The canonical name of ``encoding`` when it extends the (plain) encoding a saved
    ``config.posenc`` names (``EncodingConfig.extends``), else None."""
    if encoding is None:
        return None
    from ..errors import UnknownEncodingError
    from .registry import canonical_name, get_encoding

    try:
        name = canonical_name(encoding)
    except UnknownEncodingError:
        return None  # a pattern or an unknown name: matches_saved decides
    extends = get_encoding(name).config_class.extends
    check_saved_entry(saved)
    return name if extends and saved.get("encoding") == extends and name != extends else None


def _load_extended(
    path: str, encoding: str, encoding_params: Mapping[str, Any] | None, **kwargs: Any
) -> PreTrainedModel:
    """Load a checkpoint with its saved encoding, then switch to ``encoding``, which extends it."""
    from .patch import patch_info, unpatch_model
    from .registry import get_encoding

    config_class = get_encoding(encoding).config_class
    config_class.from_params(dict(encoding_params or {}))  # bad values: one line before loading
    model = from_pretrained(path, **kwargs)
    info = patch_info(model) or {}
    shared = set(config_class.parameter_names())
    carried = {key: value for key, value in info.get("params", {}).items() if key in shared}
    unpatch_model(model)
    patch_model(model, encoding, **{**carried, **(encoding_params or {})})
    return model
