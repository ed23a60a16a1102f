"""Apply, record and undo a patch: ``patch_model``, ``unpatch_model``, ``patched``.

Patching is in place and fully reversible. Every change is recorded as an undo action:
the encoding module attached as ``model.posenc``, the forward pre-hook on the decoder
stack, the per-instance attention forwards, the neutralised native positions, the
attention implementation name, and ``config.posenc``. ``unpatch_model`` runs them in
reverse, leaving the model exactly as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from . import __version__
from .attention import BACKENDS
from .attention.forward import PatchedAttentionForward
from .compat import (
    ATTN_IMPLEMENTATION,
    accept_generate_keyword,
    get_attn_implementation,
    register_attention_implementation,
    set_attn_implementation,
)
from .config import FORMAT_VERSION, EncodingConfig
from .encodings.base import Encoding
from .errors import AlreadyPatchedError, InvalidParameterError, NotPatchedError, UnsupportedModelError
from .models.base import Undo, replace_forward
from .registry import adapter_for, canonical_name, get_encoding
from .runtime import PatchRuntime, call_hook, release_hook

PATCH_ATTRIBUTE = "_hf_posenc_patch"
MODULE_NAME = "posenc"
CONFIG_KEY = "posenc"


@dataclasses.dataclass
class PatchRecord:
    """What ``unpatch_model`` needs: the encoding, its config, and the undo actions."""

    encoding: Encoding
    config: EncodingConfig
    runtime: PatchRuntime
    undo: list[Undo]


def _encoding_config(encoding: Any, params: Mapping[str, Any]) -> tuple[type[Encoding], EncodingConfig]:
    if isinstance(encoding, EncodingConfig):
        if params:
            raise InvalidParameterError(
                f"pass parameters inside the config object or as keywords, not both (got {sorted(params)})"
            )
        return get_encoding(encoding.encoding), encoding
    if isinstance(encoding, Mapping):  # the serialised form stored in config.posenc
        if params:
            raise InvalidParameterError("pass parameters inside the mapping or as keywords, not both")
        cls = get_encoding(encoding.get("encoding", ""))
        return cls, cls.config_class.from_params(encoding.get("params", {}))
    if not isinstance(encoding, str):
        raise InvalidParameterError(
            f"encoding must be a name, an EncodingConfig or a mapping, got {type(encoding).__name__}"
        )
    cls = get_encoding(encoding)
    return cls, cls.config_class.from_params(params)


def _model_dtype_device(model: nn.Module):
    embeddings = model.get_input_embeddings()
    return embeddings.weight.dtype, embeddings.weight.device


def patch_model(
    model: nn.Module,
    encoding: str | EncodingConfig | Mapping[str, Any],
    /,
    *,
    backend: str = "auto",
    **params: Any,
) -> nn.Module:
    """Switch ``model``'s positional encoding to ``encoding`` in place and return the model.

    ``encoding`` is a name from :func:`list_encodings` (or an alias), an encoding config
    object (e.g. ``hf_posenc.ALiBiConfig()``), or the mapping stored in ``config.posenc``.
    ``params`` are the encoding's parameters. ``backend`` picks the attention backend:
    ``"auto"`` (default: ``"chunked"`` on CPU and FlexAttention/flash-attn on CUDA for the
    encodings whose bias comes in blocks, ``"sdpa"`` for the rest), ``"sdpa"`` (the whole
    bias as one float mask), ``"chunked"``, ``"flex"``, or ``"eager"`` (explicit scores; the
    reference). See ``hf_posenc/attention/core.py``.
    """
    _reloading = params.pop("_reloading", False)
    adapter = adapter_for(model)
    adapter.check_supported(model)
    existing: PatchRecord | None = getattr(model, PATCH_ATTRIBUTE, None)
    if existing is not None:
        raise AlreadyPatchedError(
            f"this model is already patched with {existing.config.encoding!r}; "
            "call hf_posenc.unpatch_model(model) first"
        )
    if backend not in BACKENDS:
        raise InvalidParameterError(f"backend={backend!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    if MODULE_NAME in model._modules or hasattr(type(model), MODULE_NAME):
        raise UnsupportedModelError(
            f"the model already has an attribute {MODULE_NAME!r}; cannot attach the encoding"
        )

    cls, config = _encoding_config(encoding, params)
    geometry = adapter.geometry(model.config)
    config = config.resolve(geometry)
    module = cls(config, geometry)
    dtype, device = _model_dtype_device(model)
    module.to(device=device, dtype=dtype)
    if not _reloading:
        module.initialise_from_model(model, adapter)

    base = adapter.base_model(model)
    runtime = PatchRuntime(module, adapter, base, backend)
    undo: list[Undo] = []
    try:
        model.add_module(MODULE_NAME, module)
        undo.append(lambda: model._modules.pop(MODULE_NAME))
        handle = base.register_forward_pre_hook(call_hook(runtime), with_kwargs=True, prepend=True)
        undo.append(handle.remove)
        undo.append(base.register_forward_hook(release_hook(runtime)).remove)
        undo.extend(adapter.neutralize_native_positions(model))
        for layer_idx, attention in enumerate(adapter.attention_modules(model)):
            undo.append(replace_forward(attention, PatchedAttentionForward(attention, layer_idx, runtime)))
        if cls.takes_coordinates and hasattr(type(model), "_validate_model_kwargs"):
            undo.append(accept_generate_keyword(model, "position_coordinates"))
        register_attention_implementation()
        previous_impl = get_attn_implementation(model.config)
        set_attn_implementation(model.config, ATTN_IMPLEMENTATION)
        undo.append(lambda: set_attn_implementation(model.config, previous_impl))
        setattr(
            model.config,
            CONFIG_KEY,
            {
                "encoding": cls.name,
                "params": config.to_dict(),
                "format_version": FORMAT_VERSION,
                "hf_posenc_version": __version__,
            },
        )
        undo.append(lambda: delattr(model.config, CONFIG_KEY))
        undo.append(runtime.reset)
    except BaseException:
        for action in reversed(undo):
            action()
        raise
    setattr(model, PATCH_ATTRIBUTE, PatchRecord(module, config, runtime, undo))
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` exactly: outputs, state_dict keys, modules and config."""
    record: PatchRecord | None = getattr(model, PATCH_ATTRIBUTE, None)
    if record is None:
        raise NotPatchedError(f"{type(model).__name__} is not patched by hf_posenc; nothing to undo")
    for action in reversed(record.undo):
        action()
    delattr(model, PATCH_ATTRIBUTE)
    return model


@contextlib.contextmanager
def patched(
    model: nn.Module, encoding: str | EncodingConfig | Mapping[str, Any], /, **params: Any
) -> Iterator[nn.Module]:
    """Context manager: the model is patched inside the block and restored after it."""
    patch_model(model, encoding, **params)
    try:
        yield model
    finally:
        unpatch_model(model)


def patch_info(model: nn.Module) -> dict[str, Any] | None:
    """``{'encoding': name, 'params': {...}}`` of a patched model, or None."""
    record: PatchRecord | None = getattr(model, PATCH_ATTRIBUTE, None)
    if record is None:
        return None
    return {"encoding": canonical_name(record.config.encoding), "params": record.config.to_dict()}
