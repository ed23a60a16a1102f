"""Every place hf_posenc touches a transformers internal that may move between versions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

#: The attention implementation name a patched model's config carries. Masks for it are
#: built by transformers' ``sdpa_mask`` (boolean, or None for plain causal), which is the
#: format :func:`hf_posenc.attention.core.attend` expects.
ATTN_IMPLEMENTATION = "hf_posenc"


def register_attention_implementation() -> None:
    """Register our namespaced name with transformers (idempotent, never touches 'sdpa'/'eager')."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def get_attn_implementation(config: Any) -> str | None:
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, name: str | None) -> None:
    config._attn_implementation = name


def accept_generate_keyword(model: Any, keyword: str):
    """Let ``model.generate()`` pass ``keyword`` through to forward; return the undo.

    transformers' ``GenerationMixin._validate_model_kwargs`` rejects keywords that no forward
    signature names; ours (``position_coordinates``) is consumed by the patch's pre-hook. The
    override is set on this instance only and removed by the undo."""
    validate = type(model)._validate_model_kwargs

    def _validate_model_kwargs(model_kwargs: dict[str, Any]) -> None:
        model_kwargs = {k: v for k, v in model_kwargs.items() if k != keyword}
        return validate(model, model_kwargs)

    model._validate_model_kwargs = _validate_model_kwargs

    def undo() -> None:
        del model._validate_model_kwargs

    return undo


@contextlib.contextmanager
def ignore_unexpected_keys(model_class: type, pattern: str) -> Iterator[None]:
    """While loading ``model_class``, do not report checkpoint keys matching ``pattern``."""
    previous = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected", None)
    had = "_keys_to_ignore_on_load_unexpected" in model_class.__dict__
    inherited = set(getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or [])
    model_class._keys_to_ignore_on_load_unexpected = sorted(inherited | {pattern})
    try:
        yield
    finally:
        if had:
            model_class._keys_to_ignore_on_load_unexpected = previous
        else:
            del model_class._keys_to_ignore_on_load_unexpected


def resolve_checkpoint_file(path: str, filename: str, **hub_kwargs: Any) -> str | None:
    """Local path of ``filename`` in a checkpoint directory or hub repo, or None if absent."""
    from transformers.utils import cached_file

    return cached_file(
        path,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub_kwargs,
    )
