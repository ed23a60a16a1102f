"""State shared by the pieces of one patch: encodings, adapter, memos and positions.

One :class:`PatchRuntime` per patch, plain or hybrid: its ``before_base_forward`` runs as a forward
pre-hook on the decoder stack, computes the positions once (see :mod:`hf_posenc.core.positions`),
hands them to the model as ``position_ids`` so every layer receives the same tensor, gives them to
every part (one :class:`PartRuntime` per distinct encoding; a plain patch has one) and applies the
``embed`` stage.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..compat import cache_argument, check_attn_implementation, reentrant_checkpointing
from ..encodings.base import Encoding
from ..encodings.call import ForwardCall
from ..errors import InvalidParameterError, UnsupportedModelError
from ..models.base import FamilyAdapter
from .decoding_state import layer_state
from .memo import ForwardMemo
from .positions import ForwardContext, bind_arguments, compute_context, positional_names, select_coordinates

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..attention.head_parallel import HeadParallel
    from ..attention.shifted import ShiftedSparse


class PartRuntime:
    """What the attention forwards of one part's layers read: its encoding, adapter, backend,
    per-forward memo and context, active stages and decoding-state token. A plain patch has one
    part; a hybrid one per distinct encoding.

    Transient per-forward values (memo, context) are not copied or pickled."""

    def __init__(self, encoding: Encoding, adapter: FamilyAdapter, backend: str, token: str) -> None:
        self.encoding = encoding
        self.adapter = adapter
        self.backend = backend
        #: identifies this part's decoding state on a shared KV cache
        self.token = token
        #: attention backends that failed on this model (e.g. a FlexAttention compile error) and
        #: are not asked again; per model, so one model's failure never affects another
        self.failed_backends: set[str] = set()
        #: the kernel that served each kind of call (``AttentionCall.kernels``), per model
        self.kernel_choices: dict[str, str] = {}
        #: the stages this encoding runs (``Encoding.active_stages``)
        self.stages = self._stages()
        #: encodings that carry state between decoding steps say so with ``stateful = True``
        self.stateful = bool(getattr(encoding, "stateful", False))
        #: encodings whose decoding state is optional work to reuse (``Encoding.reuses_decoding_work``)
        self.reuses_decoding_work = bool(getattr(encoding, "reuses_decoding_work", False))
        #: LongLoRA's shifted sparse attention in training forwards (``enable_s2_attn``), or None
        self.s2: ShiftedSparse | None = None
        self._transient()

    @property
    def reads_positions(self) -> bool:
        """Whether this part's attention itself reads query/key positions (a score bias, explicit
        scores, a ``logits`` stage, a positional stream, decoding state), rather than finding them
        already inside q and k (rotations, input codes): then the keys of a static cache must sit
        where a dynamic cache puts them (:mod:`hf_posenc.attention.static_cache`)."""
        reading = {"logits", "score_bias", "transform_scores", "normalize"}
        return (
            bool(self.stages & reading)
            or self.stateful
            or bool(getattr(self.encoding, "attends_stream", False))
        )

    def _stages(self) -> frozenset[str]:
        return frozenset(self.encoding.active_stages())

    def refresh_stages(self) -> None:
        """Re-read the encoding's active stages after its parameters changed (``reconfigure``:
        RoPE switches between ``rotate`` and ``logits`` with dynamic scaling)."""
        stages = self._stages()
        if ("embed" in stages) != ("embed" in self.stages):
            raise InvalidParameterError(
                f"{self.encoding.name}: this change switches the embed stage on or off, which reconfigure "
                "cannot do in place; allowed: unpatch_model and patch_model again"
            )
        self.stages = stages

    def _transient(self) -> None:
        self.memo = ForwardMemo()
        self.context: ForwardContext | None = None
        #: head-parallel attention over a process group (``enable_head_parallel``), or None; holds a
        #: process group, so it is not copied or pickled
        self.head_parallel: HeadParallel | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("memo", "context", "head_parallel"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._transient()

    def start(self, context: ForwardContext) -> None:
        """Take the positions of the forward that begins."""
        self.context = context
        self.memo.start(context.positions)

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
        """This layer's decoding state for ``cache`` (stored on the cache, following its
        reorder/crop/batch operations; see :mod:`hf_posenc.core.decoding_state`), or None: without
        a cache, and for an encoding that only reuses work (``reuses_decoding_work``) under
        torch.compile or over a static (pre-allocated, compileable) cache."""
        if cache is None or not (self.stateful or self.reuses_decoding_work):
            return None
        if not self.stateful and (torch.compiler.is_compiling() or getattr(cache, "is_compileable", False)):
            return None
        return layer_state(
            cache, self.token, layer_idx, self.encoding.state_sequence_dims, owner=self.encoding.name
        )

    def finish(self) -> None:
        """Once the decoder stack has run: drop the forward's shared tensors (biases, cos/sin,
        folded masks) instead of holding them until the next forward."""
        self.memo.release()
        if torch.compiler.is_compiling():
            # a compiled forward's tensors may be CUDA-graph outputs that the next replay
            # overwrites; kept on the runtime, dynamo's guards would read them on the next call
            self.context = None
            self.memo.clear()

    def reset(self) -> None:
        self.context = None
        self.memo.clear()


class PatchRuntime:
    """The runtime of one patch, plain or hybrid: its parts (one :class:`PartRuntime` each) behind
    one pair of hooks on the decoder stack. The positions are computed once per forward and handed
    to every part; a part with an ``embed`` stage adds its vectors to the token embeddings.

    Its hooks are bound methods (``before_base_forward``, ``after_base_forward``) so that
    ``copy.deepcopy`` and pickling a patched model give the copy its own runtime; the pending
    embedding of a forward is not copied or pickled."""

    def __init__(self, parts: list[PartRuntime], base: nn.Module) -> None:
        self.parts = parts
        #: positional parameter names of the decoder stack's forward (``self`` dropped)
        self.base_names = positional_names(inspect.signature(type(base).forward))[1:]
        self.pending_embedding: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("pending_embedding", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.pending_embedding = None

    @property
    def stages(self) -> frozenset[str]:
        """Every stage some part runs."""
        return frozenset().union(*(part.stages for part in self.parts))

    def before_base_forward(self, base: PreTrainedModel, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook (``with_kwargs=True``) on the decoder stack."""
        prepared = prepare_forward(
            self.base_names,
            base,
            args,
            kwargs,
            encodings=[part.encoding for part in self.parts],
            want_key_positions="logits" in self.stages,
        )
        if prepared is None:
            return args, kwargs  # let the model raise its own error
        call, context, batch, length = prepared
        if torch.compiler.is_compiling() and getattr(cache_argument(call), "is_compileable", False):
            for part in self.parts:
                refusal = part.encoding.compiled_decoding_refusal()
                if refusal is not None:
                    raise UnsupportedModelError(refusal)
        call["position_ids"] = context.positions
        for part in self.parts:
            part.start(context)
        for part in self.parts:
            if "embed" in part.stages:  # never in a hybrid (refused there)
                self._add_embed_stage(base, call, part, context, batch, length)
        return (), call

    def _add_embed_stage(
        self,
        base: PreTrainedModel,
        call: dict[str, Any],
        part: PartRuntime,
        context: ForwardContext,
        batch: int,
        length: int,
    ) -> None:
        """Add ``part``'s ``embed`` stage to the token embeddings of this forward."""
        inputs_embeds, input_ids = call.get("inputs_embeds"), call.get("input_ids")
        forward = ForwardCall(positions=context.positions, memo=part.memo, coordinates=context.coordinates)
        added = part.encoding.embed(forward)  # (B, T, hidden) fp32
        embedding = base.get_input_embeddings()
        if inputs_embeds is None and self._embedding_hook_on(embedding):
            # added to the token embeddings by the hook on the embedding module, so the model
            # sees its own input_ids (any leading shape: GPT2DoubleHeadsModel's (B, choices, T))
            self.pending_embedding = added
            return
        if inputs_embeds is None:
            assert input_ids is not None  # one of the two is given (returned early otherwise)
            inputs_embeds = embedding(input_ids.reshape(batch, length))  # (B, T, hidden)
            call["input_ids"] = None
        call["inputs_embeds"] = inputs_embeds + added.reshape(inputs_embeds.shape).to(
            device=inputs_embeds.device, dtype=inputs_embeds.dtype
        )

    def after_base_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook: once the decoder stack has run, every part drops the forward's tensors."""
        self.pending_embedding = None
        for part in self.parts:
            part.finish()

    def hook_embedding(self, embedding: nn.Module):
        """Install :meth:`add_embedding` on the token-embedding module; return the undo."""
        self.embedding_module = embedding
        return embedding.register_forward_hook(self.add_embedding).remove

    def _embedding_hook_on(self, embedding: nn.Module) -> bool:
        # a model whose embeddings were replaced after patching (resize_token_embeddings) falls
        # back to passing inputs_embeds
        return getattr(self, "embedding_module", None) is embedding

    def add_embedding(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook on the token embeddings: add the ``embed`` stage's vectors of this forward."""
        added, self.pending_embedding = self.pending_embedding, None
        if added is None:
            return None
        return output + added.reshape(output.shape).to(device=output.device, dtype=output.dtype)

    def reset(self) -> None:
        for part in self.parts:
            part.reset()


def prepare_forward(
    base_names: tuple[str, ...],
    base: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    encodings: list[Encoding],
    want_key_positions: bool,
) -> tuple[dict[str, Any], ForwardContext, int, int] | None:
    """The decoder stack's call bound by name, with this forward's positions computed once:
    ``(call, context, batch, length)``; None when the call has neither ids nor embeddings.
    ``encodings`` are the patch's encodings (one, or a hybrid's parts)."""
    # N-D token coordinates for encodings that take them; transformers never sees the keyword
    coordinates = kwargs.pop("position_coordinates", None)
    if coordinates is not None and not any(encoding.takes_coordinates for encoding in encodings):
        from .registry import encoding_classes

        names = "+".join(encoding.name for encoding in encodings)
        takers = ", ".join(cls.name for cls in encoding_classes() if cls.takes_coordinates)
        raise InvalidParameterError(
            f"position_coordinates is not allowed with encoding {names!r}; allowed only with "
            f"encodings that take N-D coordinates ({takers})"
        )
    check_attn_implementation(base)
    streaming = [encoding.name for encoding in encodings if encoding.carries_layer_stream]
    if streaming and reentrant_checkpointing(base):
        raise UnsupportedModelError(
            f"{streaming[0]} passes a positional stream from layer to layer, which reentrant gradient "
            "checkpointing cannot differentiate; enable it with "
            'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
        )
    call = bind_arguments(base_names, args, kwargs)
    input_ids = call.get("input_ids")
    inputs_embeds = call.get("inputs_embeds")
    if input_ids is not None:
        # GPT2DoubleHeadsModel passes (batch, choices, T): the stack flattens leading dims
        batch, length = int(input_ids.numel() // max(input_ids.shape[-1], 1)), input_ids.shape[-1]
        device = input_ids.device
    elif inputs_embeds is not None:
        batch, length = (
            int(inputs_embeds[..., 0].numel() // inputs_embeds.shape[-2]),
            inputs_embeds.shape[-2],
        )
        device = inputs_embeds.device
    else:
        return None
    cache = cache_argument(call)
    attention_mask = call.get("attention_mask")
    position_ids = call.get("position_ids")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 3:
        attention_mask = attention_mask.reshape(batch, -1)
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim > 2:
        position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 1:
        position_ids = position_ids[None]
    context = compute_context(
        batch=batch,
        length=length,
        device=device,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        want_key_positions=want_key_positions,
    )
    if coordinates is not None:
        context.coordinates = select_coordinates(
            coordinates, batch=batch, length=length, device=device, past_key_values=cache
        )
    return call, context, batch, length
