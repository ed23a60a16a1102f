"""Every place hf_posenc touches a transformers internal that may move between versions."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .errors import UnsupportedModelError
from .models.base import RestoreAttribute

#: The attention implementation name a patched model's config carries. Masks for it are
#: built by transformers' ``sdpa_mask`` (boolean, or None for plain causal), which is the
#: format :func:`hf_posenc.attention.core.attend` expects.
ATTN_IMPLEMENTATION = "hf_posenc"


def register_attention_implementation() -> None:
    """Register our namespaced name with transformers (idempotent, never touches 'sdpa'/'eager')."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


#: attention implementations whose masks a patched forward reads (boolean from sdpa_mask, additive
#: float from eager_mask); set after patching, the patch keeps working under them
MASK_COMPATIBLE_IMPLEMENTATIONS = (ATTN_IMPLEMENTATION, "sdpa", "eager")


def check_attn_implementation(base: Any) -> None:
    """Refuse a forward of a patched model whose attention implementation was switched (after
    patching) to one whose masks it cannot read (flash-attention's unpadded 2D masks, ...)."""
    from .errors import UnsupportedModelError

    name = get_attn_implementation(base.config)
    if name not in MASK_COMPATIBLE_IMPLEMENTATIONS and name is not None:
        raise UnsupportedModelError(
            f"the model's attention implementation was set to {name!r} after patching; a patched model runs "
            f"with {', '.join(map(repr, MASK_COMPATIBLE_IMPLEMENTATIONS))} (pick the kernel with "
            "patch_model(..., backend=...)); call model.set_attn_implementation('sdpa') or unpatch first"
        )


def get_attn_implementation(config: Any) -> str | None:
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, name: str | None) -> None:
    config._attn_implementation = name


class AcceptGenerateKeyword:
    """Let ``model.generate()`` pass ``keyword`` through to forward (instance override).

    transformers' ``GenerationMixin._validate_model_kwargs`` rejects keywords that no forward
    signature names; ours (``position_coordinates``) is consumed by the patch's pre-hook. An
    object rather than a closure, so copies and pickles of the model carry their own."""

    def __init__(self, model: Any, keyword: str) -> None:
        self.model, self.keyword = model, keyword

    @classmethod
    def install(cls, model: Any, keyword: str):
        """Set the override on ``model``; return the undo."""
        undo = RestoreAttribute(model, "_validate_model_kwargs")
        model._validate_model_kwargs = cls(model, keyword)
        return undo

    def __call__(self, model_kwargs: dict[str, Any]) -> None:
        model_kwargs = {k: v for k, v in model_kwargs.items() if k != self.keyword}
        return type(self.model)._validate_model_kwargs(self.model, model_kwargs)


class GenerateCompilePolicy:
    """Whether ``generate()`` compiles its decoding step (static caches; transformers' own
    ``GenerationMixin._valid_auto_compile_criteria``, overridden on the instance).

    ``refusal``: why the patch's encodings cannot run a compiled decoding step (decoding state
    that grows beside the cache): ``generate()`` decodes eagerly, and raises that one line when
    the caller asked for compilation with ``compile_config``. ``unverified_on_cuda``: a score-bias
    encoding, seen failing under the CUDA graphs of transformers' compiled step on an H100 and not
    measured since; transformers' automatic compilation on CUDA is off for it (an explicit
    ``compile_config`` compiles), and elsewhere transformers decides (CPU: only when asked)."""

    def __init__(self, model: Any, refusal: str | None, unverified_on_cuda: bool) -> None:
        self.model, self.refusal, self.unverified_on_cuda = model, refusal, unverified_on_cuda

    @classmethod
    def install(cls, model: Any, refusal: str | None, unverified_on_cuda: bool):
        """Set the override on ``model``; return the undo."""
        undo = RestoreAttribute(model, "_valid_auto_compile_criteria")
        model._valid_auto_compile_criteria = cls(model, refusal, unverified_on_cuda)
        return undo

    def __call__(self, model_kwargs: dict[str, Any], generation_config: Any) -> bool:
        if self.refusal is not None:
            if generation_config.compile_config is not None and not generation_config.disable_compile:
                raise UnsupportedModelError(self.refusal)
            return False
        if (
            self.unverified_on_cuda
            and self.model.device.type == "cuda"
            and generation_config.compile_config is None
        ):
            return False  # automatic compilation only: an explicit compile_config is the caller's to make
        return type(self.model)._valid_auto_compile_criteria(self.model, model_kwargs, generation_config)


def attention_weights_requested() -> bool:
    """Whether the running transformers forward records attention weights (``output_attentions``).

    transformers 5 collects them with hooks on the attention modules while a context variable
    holds the collector; a patched attention must then return explicit weights."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older/newer layouts: assume not requested
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def reentrant_checkpointing(base: Any) -> bool:
    """Whether the decoder layers of ``base`` run under reentrant gradient checkpointing
    (transformers' ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``)."""
    if not getattr(base, "gradient_checkpointing", False) or not base.training:
        return False
    for module in base.modules():
        function = module.__dict__.get("_gradient_checkpointing_func")
        if function is not None:
            keywords = getattr(function, "keywords", {}) or {}
            return bool(keywords.get("use_reentrant", True))
    return False


def in_activation_checkpoint() -> bool:
    """Whether this runs inside ``torch.utils.checkpoint``'s non-reentrant region, in its forward
    or its recomputation in backward (transformers' ``gradient_checkpointing_enable`` /
    ``activation_checkpointing_enable`` with ``use_reentrant=False``): read from the innermost
    saved-tensor hooks, which are the checkpoint's own there (torch's private
    ``_top_saved_tensors_default_hooks``; False where it is missing, or where other hooks were
    installed inside the region: then the caller does what it does outside one)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if not hooks:
        return False
    name = getattr(hooks[0], "__qualname__", "")
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


@contextlib.contextmanager
def ignore_unexpected_keys(model_class: type[PreTrainedModel], pattern: str) -> Iterator[None]:
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


#: the keyword that carries the KV cache into a model, a decoder layer and an attention module:
#: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old keyword is accepted,
#: deprecated, until 5.40); earlier 5.x releases pass ``past_key_values``
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_argument(call: Mapping[str, Any]) -> Any:
    """The KV cache among a forward call's bound arguments, whichever keyword carried it (or None)."""
    for keyword in CACHE_KEYWORDS:
        value = call.get(keyword)
        if value is not None:
            return value
    return None


def cache_keyword(model: Any) -> str:
    """The keyword this model's forward takes its KV cache by (``cache`` from transformers 5.24)."""
    import inspect

    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a forward returned (``output.cache`` from transformers 5.24)."""
    fields = output.keys() if hasattr(output, "keys") else ()
    return output["cache"] if "cache" in fields else output.past_key_values


def raise_recompile_limit(limit: int) -> None:
    """Let torch.compile keep at least ``limit`` graphs per function (torch >= 2.6 calls the setting
    ``recompile_limit``, earlier ``cache_size_limit``); never lowers a user's higher setting."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))
            return


def static_layer_written(cache: Any, layer_idx: int) -> int | None:
    """For a static sliding-window cache layer: how many of the keys its last ``update`` returned
    were written (a host int transformers keeps, ``cumulative_length_int``); None for any other
    layer (a full static layer counts in a 0-d tensor, read through ``get_seq_length``).

    transformers' ``StaticSlidingWindowLayer`` returns its window buffer filled from the start
    until the window is full, then exactly the keys in the window, bottom-right aligned."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    written = getattr(layers[layer_idx], "cumulative_length_int", None)
    return written if isinstance(written, int) else None


@functools.cache
def thread_counts_per_caller() -> bool:
    """Whether ``torch.set_num_threads`` sets the intra-op thread count of the calling thread
    alone, as torch's OpenMP backend does (OpenMP's and MKL's counts are per thread), so a worker
    thread may run single-threaded operations beside the caller's (``attention.thread_split``).
    torch's native thread pool backend takes one count for the process, once (a later call only
    warns), and TBB builds are not checked: there, no split."""
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
