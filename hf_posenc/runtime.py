"""State shared by the pieces of one patch: encoding, adapter, memo and positions.

``before_base_forward`` runs as a forward pre-hook on the decoder stack: it computes the
positions once (see :mod:`hf_posenc.positions`), hands them to the model as
``position_ids`` so every layer receives the same tensor, and applies the ``embed`` stage.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from .attention.blocks import BLOCK_BACKENDS
from .encodings.base import STAGES, Encoding
from .errors import InvalidParameterError, UnsupportedModelError
from .memo import ForwardMemo
from .models.base import FamilyAdapter
from .positions import ForwardContext, bind_arguments, compute_context, select_coordinates


@dataclasses.dataclass(frozen=True)
class Stages:
    embed: bool
    layer_input: bool
    adjust_qkv: bool
    rotate: bool
    logits: bool
    score_bias: bool
    transform_scores: bool
    normalize: bool
    adjust_output: bool


class PatchRuntime:
    def __init__(self, encoding: Encoding, adapter: FamilyAdapter, base: nn.Module, backend: str) -> None:
        self.encoding = encoding
        self.adapter = adapter
        self.backend = backend
        #: the block backend that serves this encoding's score bias, None: the full sdpa/eager core
        self.block_backend = (
            backend if backend in BLOCK_BACKENDS and type(encoding).has_block_bias() else None
        )
        active = set(encoding.active_stages())
        self.stages = Stages(**{s: s in active for s in STAGES})
        self.memo = ForwardMemo()
        self.context: ForwardContext | None = None
        #: encodings that carry state between decoding steps say so with ``stateful = True``
        self.stateful = bool(getattr(encoding, "stateful", False))
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        params = list(inspect.signature(type(base).forward).parameters.values())[1:]
        self._base_signature = inspect.Signature(params)

    def before_base_forward(self, base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # N-D token coordinates for encodings that take them; transformers never sees the keyword
        coordinates = kwargs.pop("position_coordinates", None)
        if coordinates is not None and not self.encoding.takes_coordinates:
            raise InvalidParameterError(
                f"position_coordinates is not allowed with encoding {self.encoding.name!r}; allowed only with "
                "encodings that take N-D coordinates (e.g. rope2d, comrope)"
            )
        call = bind_arguments(self._base_signature, args, kwargs)
        input_ids = call.get("input_ids")
        inputs_embeds = call.get("inputs_embeds")
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None:
            return args, kwargs  # let the model raise its own error
        cache = call.get("past_key_values")
        if cache is not None and getattr(cache, "is_compileable", False):
            raise UnsupportedModelError(
                f"{type(cache).__name__} (a pre-allocated, compileable KV cache) is not supported by a patched "
                "model yet; use the default DynamicCache (generate() without cache_implementation)"
            )
        context = compute_context(
            batch=reference.shape[0],
            length=reference.shape[1],
            device=reference.device,
            attention_mask=call.get("attention_mask"),
            position_ids=call.get("position_ids"),
            past_key_values=cache,
            want_key_positions=self.stages.logits,
        )
        if coordinates is not None:
            context.coordinates = select_coordinates(
                coordinates,
                batch=reference.shape[0],
                length=reference.shape[1],
                device=reference.device,
                past_key_values=cache,
            )
        call["position_ids"] = context.positions
        self.context = context
        self.memo.start(context.positions)
        if self.stages.embed:
            if inputs_embeds is None:
                inputs_embeds = base.get_input_embeddings()(input_ids)  # (B, T, hidden)
                call["input_ids"] = None
            added = self.encoding.embed(context.positions, self.memo)  # (B, T, hidden) fp32
            call["inputs_embeds"] = inputs_embeds + added.to(
                device=inputs_embeds.device, dtype=inputs_embeds.dtype
            )
        return (), call

    def context_for(self, position_ids: torch.Tensor | None, hidden: torch.Tensor) -> ForwardContext:
        """The context of the running forward; rebuilt from ``position_ids`` when called outside it."""
        context = self.context
        if context is not None and (position_ids is None or position_ids is context.positions):
            return context
        batch, length = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(length, device=hidden.device)[None]
        positions = position_ids.to(hidden.device).expand(batch, -1)
        self.memo.start(position_ids)
        return ForwardContext(positions=positions, key_positions=positions)

    def layer_state(self, cache: Any, layer_idx: int) -> dict[str, Any] | None:
        """This layer's decoding state for ``cache`` (a dict living as long as the cache), or None."""
        if cache is None:
            return None
        return self._states.setdefault(cache, {}).setdefault(layer_idx, {})

    def reset(self) -> None:
        self.context = None
        self.memo.clear()


def call_hook(runtime: PatchRuntime):
    """A forward pre-hook (``with_kwargs=True``) bound to ``runtime``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        return runtime.before_base_forward(module, args, kwargs)

    return hook


def release_hook(runtime: PatchRuntime):
    """A forward hook: once the decoder stack has run, drop the forward's shared tensors
    (biases, cos/sin, folded masks) instead of holding them until the next forward."""

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        runtime.memo.release()

    return hook
