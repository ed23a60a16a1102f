"""The forward installed on every patched attention module: composes the encoding's stages.

    hidden ─ layer_input ─> project q,k,v ─ adjust_qkv ─ rotate ─> KV cache
           ─ logits, score_bias ─> attend (transform_scores, normalize) ─ adjust_output ─> output

One instance per attention module; it holds the module, its layer index, the family
adapter and the shared :class:`~hf_posenc.runtime.PatchRuntime`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..compat import attention_weights_requested
from ..encodings.base import ScoreContext
from ..errors import InvalidParameterError
from ..positions import bind_arguments, positional_names
from . import chunked
from .blocks import BLOCK_BACKENDS, attend_blocks
from .core import attend, fold_mask

if TYPE_CHECKING:
    from ..positions import ForwardContext
    from ..runtime import PatchRuntime


class PatchedAttentionForward:
    """Callable used as ``module.forward`` while a model is patched."""

    def __init__(self, module: nn.Module, layer_idx: int, runtime: PatchRuntime) -> None:
        self.module = module
        self.layer_idx = layer_idx
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
        cache = call.get("past_key_values")
        runtime, module, layer = self.runtime, self.module, self.layer_idx
        encoding, adapter, memo, stages = runtime.encoding, runtime.adapter, runtime.memo, runtime.stages
        context = runtime.context_for(call.get("position_ids"), hidden)
        positions = context.positions  # (B, T)
        state = runtime.layer_state(cache, layer) if runtime.stateful else None

        x_qk = x_v = hidden
        if stages.layer_input:
            x_qk, x_v = encoding.layer_input(layer, hidden, positions, memo)
        q, k, v = adapter.project(module, x_qk, x_v)  # (B,Hq,T,D), (B,Hkv,T,D), (B,Hkv,T,D)
        if stages.adjust_qkv:
            q, k, v = encoding.adjust_qkv(layer, hidden, positions, q, k, v, state, memo)
        if stages.rotate:
            extra = {"coordinates": context.coordinates} if encoding.takes_coordinates else {}
            q, k = encoding.rotate(layer, q, k, positions, positions, memo, **extra)
        if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            # every layer receives the same mask object: convert (and check) it once per forward
            # (under torch.compile there is no memo, and id() cannot be traced)
            if torch.compiler.is_compiling():
                mask = boolean_mask(mask)
            else:
                mask = memo.get(("boolean_mask", id(mask)), lambda: boolean_mask(mask))  # (B|1, 1, Tq, Tk)
        if cache is not None:
            k, v = cache.update(k, v, layer)  # (B, Hkv, Tk, D)
            allocated = k.shape[-2]
            if getattr(cache, "is_compileable", False):
                # a static cache returns its whole pre-allocated buffer, filled from the start: keep
                # the keys written so far, so queries sit bottom-right as with a dynamic cache
                valid = min(context.past_length + q.shape[-2], allocated)
                k, v = k[:, :, :valid], v[:, :, :valid]
                mask = None if mask is None else mask[..., :valid]

        score = ScoreContext(layer, q, k, hidden, positions, memo, state)
        plain = not (stages.logits or stages.transform_scores or stages.normalize)
        want_weights = attention_weights_requested()
        fused = None
        if runtime.backend == "auto" and q.device.type == "cuda" and not want_weights:
            fused = encoding.fused_attention(q, k, v, mask, module.scaling)  # (B, Tq, Hq, D) or None
        if want_weights:
            # output_attentions: explicit weights from the eager core, whatever the backend
            out, weights = self._attend_full(score, context, q, k, v, mask, plain, force_eager=True)
        elif fused is not None:
            out, weights = fused, None
        elif stages.score_bias and plain and runtime.block_backend is not None:
            out = attend_blocks(
                runtime.block_backend,
                q,
                k,
                v,
                bias=encoding.block_bias(score),
                mask=mask,
                scaling=module.scaling,
                dropout_p=adapter.dropout_p(module),
                memo=memo,
            )
            weights = None
        elif (
            runtime.backend in BLOCK_BACKENDS
            and not stages.logits
            and (stages.transform_scores or stages.normalize)
            and encoding.rows_independent()
            and q.shape[-2] > chunked.QUERY_BLOCK
        ):
            out, weights = self._attend_row_blocks(score, context, q, k, v, mask), None
        else:
            out, weights = self._attend_full(score, context, q, k, v, mask, plain)
        if weights is not None and cache is not None and weights.shape[-1] < allocated:
            # output_attentions over a static cache: native maps span the whole buffer (unused slots 0)
            weights = torch.nn.functional.pad(weights, (0, allocated - weights.shape[-1]))
        out = out.reshape(*hidden.shape[:-1], -1).contiguous()  # (B, T, Hq*D)
        if stages.adjust_output:
            out = encoding.adjust_output(layer, hidden, out, state, memo)
        return adapter.output(module, out), weights

    def _attend_row_blocks(
        self,
        score: ScoreContext,
        context: ForwardContext,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Explicit scores (transform_scores / normalize) one block of queries at a time -> (B,Tq,Hq,D).

        Each query's weights depend on its own row of scores only (``rows_independent``), so
        blocks of queries, each with just the keys it may attend (bottom-right aligned, as a
        whole call is), give the whole result with one block of scores in memory; with
        gradients each block is recomputed in backward.
        """
        q_len, k_len = q.shape[-2], k.shape[-2]
        offset, block = k_len - q_len, chunked.QUERY_BLOCK

        def one_block(q_block: torch.Tensor, start: int, stop: int) -> torch.Tensor:
            k_end = offset + stop
            keys, values = k[:, :, :k_end], v[:, :, :k_end]
            rows = ScoreContext(
                score.layer_idx,
                q_block,
                keys,
                score.hidden[:, start:stop],
                score.q_positions[:, start:stop],
                score.memo,
                score.state,
            )
            block_mask = None if mask is None else mask[..., start:stop, :k_end]
            return self._attend_full(rows, context, q_block, keys, values, block_mask, plain=False)[0]

        outputs = []
        for start in range(0, q_len, block):
            stop = min(q_len, start + block)
            q_block = q[:, :, start:stop]
            if torch.is_grad_enabled():
                outputs.append(checkpoint(one_block, q_block, start, stop, use_reentrant=False))
            else:
                outputs.append(one_block(q_block, start, stop))
        return torch.cat(outputs, dim=1)  # (B, Tq, Hq, D)

    def _attend_full(
        self,
        score: ScoreContext,
        context: ForwardContext,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        plain: bool,
        force_eager: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sdpa/eager core with the whole (B|1, Hq, Tq, Tk) bias (or none)."""
        runtime, module, layer = self.runtime, self.module, self.layer_idx
        encoding, adapter, memo, stages = runtime.encoding, runtime.adapter, runtime.memo, runtime.stages
        logits = bias = None
        if stages.logits:
            key_positions = context.key_positions[:, -k.shape[-2] :]  # (B, Tk)
            logits = encoding.logits(layer, q, k, score.q_positions, key_positions, memo)  # (B, Hq, Tq, Tk)
        if stages.score_bias:
            bias = encoding.score_bias(score)  # broadcastable to (B, Hq, Tq, Tk)
        backend = "eager" if runtime.backend == "eager" or force_eager else "sdpa"
        folded = None
        if bias is not None and plain and backend == "sdpa" and memo.holds(bias) and not bias.requires_grad:
            # a memoised grad-free bias (alibi, sandwich, ...) is shared by every layer: fold it with the mask once
            key = ("folded_mask", id(bias), id(mask), q.dtype)
            folded = memo.get(key, lambda: fold_mask(bias, mask, q.shape[-2], k.shape[-2], q.dtype))
        return attend(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            logits=logits,
            scaling=module.scaling,
            dropout_p=adapter.dropout_p(module),
            backend=backend,
            folded=folded,
            transform=(lambda scores, allowed: encoding.transform_scores(_with_mask(score, allowed), scores))
            if stages.transform_scores
            else None,
            normalize=(
                lambda scores, allowed: encoding.normalize(_with_mask(score, allowed), scores, allowed)
            )
            if stages.normalize
            else None,
        )


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


def _with_mask(score: ScoreContext, allowed: torch.Tensor | None) -> ScoreContext:
    """``score`` with ``allowed`` set: the mask the core applies after the score stages."""
    score.allowed = allowed
    return score
