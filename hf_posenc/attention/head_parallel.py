"""Head-parallel attention: DeepSpeed Ulysses' layout for hf_posenc's own attention.

Under Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509)
each of N ranks holds T/N tokens of every sequence. Around attention an all-to-all swaps the
split, so every rank attends Hq/N heads over all T tokens, and a second all-to-all swaps it back.
DeepSpeed does this inside the transformers attention function (``UlyssesSPAttentionHF``), which a
patched model never calls (hf_posenc's forward attends itself), and with no notion of per-head
encoding parameters. This module is the same exchange for :mod:`~hf_posenc.attention.forward`::

    the rank's tokens, all heads             all tokens, heads offset .. offset + Hq/N - 1
    q (B, Hq, T/N, D)   ── all-to-all ──>    q (B, Hq/N, T, D)       (k, v: Hkv heads likewise)
    positions (B, T/N)  ── all-gather ──>    (B, T)
    hidden (B, T/N, C)  ── all-gather ──>    (B, T, C)  only when the score stages read it (FoX's gates)
    bias: the encoding's form of all heads, restricted to the rank's heads (``BlockBias.heads``)
    out (B, T, Hq/N, D) ── all-to-all ──>    (B, T/N, Hq, D)

with ``offset = rank * Hq/N``: every per-head quantity (ALiBi slopes, T5/KERPLE tables, FIRE's
per-head pieces, FoX's gates) is taken for the rank's global heads. Everything before the exchange
(layer input, projections, rotations) and after it (``adjust_output``, the output projection) is
per token and runs on the rank's tokens. Query head h reads KV head h // (Hq/Hkv), so the rank's
query heads read exactly its KV heads when N divides Hkv.

The collective is ``torch.distributed.all_to_all_single`` in an autograd function whose backward
swaps the gradients back (gloo on CPU, NCCL on GPUs); an all-gather is an all-to-all of
N copies, whose backward sums each rank's gradient back to the tokens' owner. We write this
exchange because DeepSpeed's (``UlyssesSPAttentionHF``) is bound to the transformers attention
signature, has no head offset and cannot carry the encoding's per-token inputs.

Served: every encoding whose attention is SDPA over per-token q/k (rotations, embeddings, layer
inputs) or such attention plus a score bias, and explicit score stages that treat every head alike
and apart (``Encoding.heads_independent``: SelfExtend/ReRoPE's two maps, CoPE, stick-breaking; the
``logits`` stage reads the gathered positions of every token); refused
(:func:`head_parallel_refusal`): explicit score stages that mix the heads (CAPE's MLP over them),
stages that mix neighbouring tokens before the exchange, positional streams.
The sequence must be causal over all T tokens (no padding, no packed documents), each rank passing
its tokens' true position ids; a forward with cached keys (decoding) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.layout import causal_mask
from ..encodings.block_bias import BlockBias
from ..encodings.call import LayerCall
from ..errors import InvalidParameterError

#: stages that compute or rewrite the (Tq, Tk) score matrix itself
_EXPLICIT = ("logits", "transform_scores", "normalize")


def head_parallel_refusal(encoding: Any) -> str | None:
    """Why head-parallel attention cannot serve ``encoding`` (the end of one line), or None.

    Asked of the encoding's active stages and flags (:class:`~hf_posenc.encodings.base.Encoding`),
    never of its name."""
    stages = set(encoding.active_stages())
    explicit = [stage for stage in _EXPLICIT if stage in stages]
    if explicit and not encoding.heads_independent():
        return (
            f"its explicit score stages ({', '.join(explicit)}) mix or parametrise the heads, which head-parallel "
            "attention does not split"
        )
    if "adjust_qkv" in stages:
        return (
            "its adjust_qkv stage may mix neighbouring tokens, which lie on other ranks before the exchange"
        )
    if getattr(encoding, "attends_stream", False) or getattr(encoding, "carries_layer_stream", False):
        return "it carries a positional stream beside the values, which the exchange does not move"
    return None


class _AllToAll(torch.autograd.Function):
    """``torch.distributed.all_to_all_single`` over dim 0, whose backward is the same exchange of
    the gradients (torch.distributed.nn's autograd version is deprecated in torch 2.13)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(N, ...) -> (N, ...): chunk n goes to rank n, chunk n received came from rank n (differentiable)."""
    return _AllToAll.apply(x, group)


@dataclasses.dataclass(frozen=True)
class HeadParallel:
    """The exchange of one process group: ``size`` ranks, this one ``rank``."""

    group: Any  # a torch.distributed ProcessGroup; None: the default group
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any = None) -> HeadParallel:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidParameterError(
                "head-parallel attention needs an initialised torch.distributed process group; allowed: call "
                "it inside a launched run (accelerate launch / torchrun), after the process group starts"
            )
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    # -- layouts ------------------------------------------------------------------------------
    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T/N, D) the rank's tokens -> (B, H/N, T, D) the rank's heads over every token."""
        batch, heads, length, width = x.shape
        n = self.size
        chunks = x.reshape(batch, n, heads // n, length, width).movedim(1, 0)  # (N, B, H/N, T/N, D)
        received = _exchange(chunks, self.group)  # (N, B, H/N, T/N, D): chunk n = rank n's tokens
        return received.movedim(0, 2).reshape(batch, heads // n, n * length, width)

    def to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H/N, D) the rank's heads -> (B, T/N, H, D) every head of the rank's tokens."""
        batch, length, heads, width = out.shape
        n = self.size
        chunks = out.reshape(batch, n, length // n, heads, width).movedim(1, 0)  # (N, B, T/N, H/N, D)
        received = _exchange(chunks, self.group)  # chunk n = heads of rank n
        return received.movedim(0, 2).reshape(batch, length // n, n * heads, width)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/N, ...) -> (B, T, ...): every rank's tokens in rank order (differentiable)."""
        copies = x.unsqueeze(0).expand(self.size, *x.shape)  # (N, B, T/N, ...)
        received = _exchange(copies, self.group)  # chunk n = rank n's tokens
        return received.movedim(0, 1).flatten(1, 2)

    # -- one attention call ---------------------------------------------------------------------
    def gather(
        self,
        layer: LayerCall,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        past: int | torch.Tensor,
        reads_hidden: bool,
    ) -> tuple[LayerCall, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rank's tokens -> the rank's heads over the sequence: the call (positions, and the
        layer input when ``reads_hidden``, of every token), q (B, Hq/N, T, D), k, v (B, Hkv/N, T, D)."""
        if not isinstance(past, int) or past != 0:
            raise InvalidParameterError(
                "head-parallel attention with cached keys is not allowed (decoding); allowed: training "
                "forwards over whole sequences (disable head-parallel attention to generate)"
            )
        for name, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
            if heads % self.size:
                raise InvalidParameterError(
                    f"head-parallel attention over {self.size} ranks: {heads} {name} heads is not allowed; "
                    f"allowed: a head count divisible by {self.size}"
                )
        local = q.shape[-2]
        if mask is not None:
            causal = layer.memo.get(("head_parallel_mask", id(mask)), lambda: _is_causal(mask, local))
            if not causal:
                raise InvalidParameterError(
                    "head-parallel attention with a padding or packed-document attention mask is not allowed; "
                    "allowed: whole causal sequences (no padding), each rank passing its tokens' position ids"
                )
        positions = layer.memo.get(
            ("head_parallel_positions", id(layer.positions)), lambda: self._positions(layer)
        )
        hidden = (
            self.gather_tokens(layer.hidden) if reads_hidden else layer.hidden.new_zeros(*positions.shape, 0)
        )
        call = dataclasses.replace(layer, positions=positions, hidden=hidden, state=None)
        return call, self.to_heads(q), self.to_heads(k), self.to_heads(v)

    def _positions(self, layer: LayerCall) -> torch.Tensor:
        positions = self.gather_tokens(layer.positions)  # (B, T)
        steps = positions[:, 1:] - positions[:, :-1]
        if bool((steps != 1).any()):
            raise InvalidParameterError(
                "head-parallel attention: the position ids gathered over the ranks do not run 0, 1, 2, ... "
                "through the sequence; allowed: each rank passes its own tokens' position ids (not 0 .. T/N-1), "
                "no packed documents"
            )
        return positions

    def own_heads(self, bias: BlockBias, heads: int) -> BlockBias:
        """The bias of this rank's ``heads`` query heads, from the form of all heads."""
        offset = self.rank * heads
        return bias.heads(offset, offset + heads)


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether a (B|1, 1, T/N, T/N) boolean mask is the plain causal mask (nothing padded)."""
    return mask.shape[-2:] == (length, length) and bool(
        (mask == causal_mask(length, length, mask.device)).all()
    )
