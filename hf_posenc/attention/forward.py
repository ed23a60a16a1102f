"""The forward installed on every patched attention module: composes the encoding's stages.

    hidden ─ layer_input ─> project q,k,v ─ adjust_qkv ─ rotate ─> KV cache ─ score_bias
           ─> dispatch to a backend (logits, transform_scores, normalize) ─ adjust_output ─> output

Every stage receives the layer's typed call (:mod:`hf_posenc.encodings.call`); the attention
itself is one :class:`~.backend.AttentionCall` that :func:`~.backend.dispatch` hands to the
first registered backend that serves it.

One instance per attention module; it holds the module, its layer index, the family
adapter and the shared :class:`~hf_posenc.core.runtime.PartRuntime`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..compat import attention_weights_requested, cache_argument
from ..core.positions import bind_arguments, positional_names
from ..encodings.call import LayerCall
from ..errors import InvalidParameterError
from .backend import AttentionCall, dispatch, dispatch_chained, dispatch_with_stream
from .head_parallel import HeadParallel
from .shifted import shifted_sparse_attention
from .static_cache import StaticKeys, rolled_key_positions, static_cache_keys

if TYPE_CHECKING:
    from ..core.runtime import PartRuntime


class PatchedAttentionForward:
    """Callable used as ``module.forward`` while a model is patched."""

    def __init__(
        self, module: nn.Module, layer_idx: int, runtime: PartRuntime, encoding_layer_idx: int | None = None
    ) -> None:
        self.module = module
        #: the model's layer index (the KV cache's)
        self.layer_idx = layer_idx
        #: the layer as the encoding numbers it: a hybrid's part counts only the layers it owns
        self.encoding_layer_idx = layer_idx if encoding_layer_idx is None else encoding_layer_idx
        self.runtime = runtime
        # positional parameter names without ``self``: calls bind as they arrive at the bound method
        self.names = positional_names(inspect.signature(type(module).forward))[1:]

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        # Llama/Mistral layers call with keywords only, GPT-2 passes hidden_states first
        if not args:
            return kwargs
        if len(args) == 1 and "hidden_states" not in kwargs:
            return {"hidden_states": args[0], **kwargs}
        return bind_arguments(self.names, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        call = self._arguments(args, kwargs)
        hidden: torch.Tensor = call["hidden_states"]  # (B, T, hidden)
        mask = call.get("attention_mask")
        cache = cache_argument(call)
        runtime, module = self.runtime, self.module
        encoding, adapter, memo, stages = runtime.encoding, runtime.adapter, runtime.memo, runtime.stages
        context = runtime.context_for(call.get("position_ids"), hidden)
        layer = LayerCall(
            positions=context.positions,  # (B, T)
            memo=memo,
            coordinates=context.coordinates,
            layer_idx=self.encoding_layer_idx,
            hidden=hidden,
            state=runtime.layer_state(cache, self.encoding_layer_idx),
        )

        x_qk = x_v = hidden
        if "layer_input" in stages:
            x_qk, x_v = encoding.layer_input(layer)
        q, k, v = adapter.project(module, x_qk, x_v)  # (B,Hq,T,D), (B,Hkv,T,D), (B,Hkv,T,D)
        if "adjust_qkv" in stages:
            q, k, v = encoding.adjust_qkv(layer, q, k, v)
        if "rotate" in stages:
            q, k = encoding.rotate(layer, q, k)
        if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            # every layer receives the same mask object: convert (and check) it once per forward
            # (under torch.compile there is no memo, and id() cannot be traced)
            if torch.compiler.is_compiling():
                mask = boolean_mask(mask)
            else:
                mask = memo.get(("boolean_mask", id(mask)), lambda: boolean_mask(mask))  # (B|1, 1, Tq, Tk)
        static: StaticKeys | None = None
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, Hkv, Tk, D)
            if getattr(cache, "is_compileable", False):  # a pre-allocated buffer (see static_cache.py)
                static = static_cache_keys(
                    cache,
                    self.layer_idx,
                    k,
                    v,
                    mask,
                    past=context.past_length,
                    new=q.shape[-2],
                    reads_positions=runtime.reads_positions,
                )
                k, v, mask = static.k, static.v, static.mask

        attended = layer  # the call of the attended tokens (adjust_output keeps the rank's own)
        parallel: HeadParallel | None = getattr(runtime, "head_parallel", None)
        if parallel is not None:  # Ulysses: the rank's heads over every token (see head_parallel.py)
            attended, q, k, v = parallel.gather(
                layer, q, k, v, mask, past=context.past_length, reads_hidden=encoding.scores_read_hidden
            )  # (B, Hq/N, T, D), (B, Hkv/N, T, D) x2
            mask = None  # checked causal: the whole sequence is attended causally

        key_positions = None
        if "logits" in stages and parallel is not None:
            key_positions = attended.positions  # (B, T): every token's, gathered (no cached keys)
        elif "logits" in stages and static is not None and static.order is not None:
            key_positions = rolled_key_positions(context.positions, k.shape[-2])  # (B, S)
        elif "logits" in stages and context.key_positions is not None:
            key_positions = context.key_positions[:, -k.shape[-2] :]  # (B, Tk)
        score = attended.with_attention(q, k, key_positions)
        attention = AttentionCall(
            score=score,
            v=v,
            mask=mask,
            softmax_scale=float(module.scaling),  # type: ignore[arg-type]  # a float on every attention module
            dropout_p=adapter.dropout_p(module),
            requested=runtime.backend,
            want_weights=attention_weights_requested(),
            encoding=encoding,
            stages=stages,
            bias=_bias(encoding, score, parallel) if "score_bias" in stages else None,
            failures=runtime.failed_backends,
            kernels=runtime.kernel_choices,
        )
        s2 = getattr(runtime, "s2", None)  # (a runtime pickled before S2-Attn existed has none)
        if s2 is not None and module.training:  # LongLoRA's S2-Attn: training forwards only
            out, weights = shifted_sparse_attention(attention, s2)  # (B, Tq, Hq, D), None
        elif encoding.attends_stream:  # (B, Tq, Hq*D + Hq*S): values, then the stream, same weights
            out, weights = dispatch_with_stream(attention, encoding.attended_stream(layer, k.shape[-2]))
        else:  # (B, Tq, Hq, D), (B, Hq, Tq, Tk) or None; recomputed in backward after recomputed q/k/v steps
            out, weights = dispatch_chained(attention) or dispatch(attention)
        if parallel is not None:
            out = parallel.to_tokens(out)  # (B, T/N, Hq, D): every head of the rank's tokens
        if weights is not None and static is not None:
            # output_attentions over a static cache: native maps span the whole buffer (unused slots 0)
            weights = static.weights_over_slots(weights)
        out = out.reshape(*hidden.shape[:-1], -1).contiguous()  # (B, T, Hq*D)
        if "adjust_output" in stages:
            out = encoding.adjust_output(layer, out)
        return adapter.output(module, out), weights


def _bias(encoding: Any, score: Any, parallel: HeadParallel | None) -> Any:
    """The encoding's score bias; under head-parallel attention, of the rank's heads only."""
    bias = encoding.score_bias(score)
    return bias if parallel is None else parallel.own_heads(bias, score.q.shape[1])


def boolean_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Any attention mask transformers or a user passes -> boolean (True = may attend), or None.

    transformers' ``sdpa_mask`` gives booleans; ``eager_mask`` (after
    ``set_attn_implementation("eager")``) and user 4D masks (packed sequences) are additive
    floats, 0 where a key may be attended and a very negative value (the dtype's minimum, or
    -inf) where not. An additive mask with other values would be a bias hf_posenc does not
    add: refused rather than silently read as allowed/masked.
    """
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0  # 0/1 integer masks
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if not torch.compiler.is_compiling() and bool((mask.masked_fill(~allowed, 0) != 0).any()):
        raise InvalidParameterError(
            "an additive float attention mask with values other than 0 (attend) and a large negative number "
            "(masked) is not allowed with a patched model; allowed: a boolean mask, or an additive mask of 0 "
            "and -inf / the dtype's minimum"
        )
    return allowed
