"""LongLoRA's shifted sparse attention (S2-Attn), a training-time attention pattern.

Chen et al. 2024, "LongLoRA: Efficient Fine-tuning of Long-Context Large Language Models"
(arXiv:2309.12307, Sec. 3.2, Algorithm 1; dvlab-research/LongLoRA ``llama_attn_replace.py``).
During training the T tokens are cut into groups of G; the first half of the heads attends
causally inside groups ``[mG, (m+1)G)``, the second half inside groups shifted by G/2, so
information flows between neighbouring groups through the shifted heads. At inference the
model attends in full, unchanged (the pattern is only a cheaper way to fine-tune long).

Two forms of the shifted half, both LongLoRA's:

``wrap=False`` (default) the shifted groups are ``[0, G/2), [G/2, 3G/2), ..., [T-G/2, T)``: the
                         partition LongLoRA's flash-attention training code uses (its
                         ``cu_seqlens`` offset by G/2; the authors' fix for the leak below,
                         dvlab-research/LongLoRA issue #90). No token sees a later one.
``wrap=True``            the paper's Algorithm 1 as written: the shifted heads' tokens are rolled
                         by -G/2, cut into groups of G, attended causally in the rolled order and
                         rolled back. The last group then holds tokens ``T-G/2 .. T-1`` followed
                         by ``0 .. G/2-1``, which attend those later tokens (the leak the authors
                         acknowledge in LongLoRA issues #15 and #90).

The positional encoding is applied before this (RoPE rotates q and k by each token's true
position on the whole sequence; absolute embeddings and ExPE-style inputs act on the hidden
states), exactly as LongLoRA rotates before shifting, so every token keeps its absolute
position in every head. Encodings whose attention adds a bias or rewrites the score matrix
(ALiBi, T5, FIRE, SelfExtend, ...) would need that term regrouped and are refused
(:func:`s2_refusal`). Each group's attention is one ordinary call to the model's backend
(SDPA's fused causal kernel when there is no padding or document mask), batched over groups.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import torch

from ..core.layout import expand_kv_heads
from ..errors import InvalidParameterError
from .backend import AttentionCall, dispatch

#: LongLoRA's group size: a quarter of the training length
DEFAULT_GROUP_RATIO = 0.25
#: stages whose attention is not plain q.k softmax over the rotated queries and keys
_SCORE_STAGES = frozenset({"logits", "score_bias", "transform_scores", "normalize"})


@dataclasses.dataclass(frozen=True)
class ShiftedSparse:
    """S2-Attn settings: a group of ``group_size`` tokens, or a fraction of the length (``group_ratio``)."""

    group_size: int | None = None
    group_ratio: float | None = None
    wrap: bool = False

    @classmethod
    def of(cls, group_size: int | float | str = DEFAULT_GROUP_RATIO, *, wrap: bool = False) -> ShiftedSparse:
        """From a group size in tokens (an even int >= 2) or a fraction of the length in (0, 1)
        (a float, or text such as ``"1/4"``)."""
        if not isinstance(wrap, bool):
            raise InvalidParameterError(f"S2-Attn: wrap={wrap!r} is not allowed; allowed: True or False")
        value: Any = group_size
        if isinstance(value, str):
            try:
                value = int(value) if value.strip().isdigit() else float(Fraction(value.strip()))
            except (ValueError, ZeroDivisionError):
                value = None
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 2 or value % 2:
                raise InvalidParameterError(
                    f"S2-Attn: group size {value!r} is not allowed; allowed: an even number of tokens >= 2 "
                    "(half the heads shift by half a group) or a fraction of the length in (0, 1), e.g. 0.25"
                )
            return cls(group_size=value, wrap=wrap)
        if isinstance(value, float) and 0 < value < 1:
            return cls(group_ratio=value, wrap=wrap)
        raise InvalidParameterError(
            f"S2-Attn: group size {group_size!r} is not allowed; allowed: an even number of tokens >= 2, or a "
            "fraction of the length in (0, 1) such as 0.25 or '1/4' (LongLoRA's)"
        )

    def describe(self) -> str:
        size = (
            f"{self.group_size} tokens"
            if self.group_size is not None
            else f"{self.group_ratio:g} of the length"
        )
        return f"groups of {size}" + (", wrapped shift" if self.wrap else "")

    def group(self, length: int) -> int:
        """The group size for a sequence of ``length`` tokens; raises unless it is even and divides it."""
        if self.group_size is not None:
            size, given = self.group_size, f"group size {self.group_size}"
        else:
            exact = length * (self.group_ratio or 0.0)
            size, given = round(exact), f"group ratio {self.group_ratio:g} ({exact:g} tokens)"
            if abs(size - exact) > 1e-9:
                size = 0
        if size < 2 or size % 2 or length % size:
            raise InvalidParameterError(
                f"S2-Attn: {given} does not cut a sequence of {length} tokens into groups; allowed: an even "
                f"group size that divides the length (e.g. {_suggestion(length)})"
            )
        return size


def _suggestion(length: int) -> str:
    sizes = [g for g in (length // 4, length // 2, length // 8) if g >= 2 and g % 2 == 0 and length % g == 0]
    return f"--s2-group-size {sizes[0]}" if sizes else "a sequence length divisible by 4"


def s2_refusal(encoding: Any) -> str | None:
    """Why S2-Attn cannot wrap ``encoding``'s attention (one line), or None when it can.

    It regroups the queries, keys and values of a plain softmax(q.k) attention; an encoding with
    a score bias or explicit-score stage, or a positional stream attended beside the values,
    would need those regrouped too."""
    stages = set(encoding.active_stages()) & _SCORE_STAGES
    if stages or getattr(encoding, "attends_stream", False):
        what = ", ".join(sorted(stages)) or "a positional stream attended beside the values"
        return (
            f"S2-Attn cannot wrap encoding {encoding.name!r}: its attention has {what}, which the shifted "
            "groups would cut; allowed: encodings applied before attention (rotary ones with a fixed scaling, "
            "absolute embeddings, ExPE-style layer inputs, position-free), and hybrids of them"
        )
    return None


def _group_rows(x: torch.Tensor, start: int, count: int, size: int) -> torch.Tensor:
    """x (B, H, T, D) -> (B*count, H, size, D): tokens ``start + m*size ..`` of group m."""
    batch, heads, _, dim = x.shape
    x = x[:, :, start : start + count * size].reshape(batch, heads, count, size, dim)
    return x.transpose(1, 2).reshape(batch * count, heads, size, dim)


def _group_mask(mask: torch.Tensor, batch: int, index: torch.Tensor) -> torch.Tensor:
    """mask (B|1, 1, T, T) and token indices (count, size) -> (B*count, 1, size, size), each group's block."""
    mask = mask.expand(batch, -1, -1, -1)
    blocks = mask[:, 0][:, index[:, :, None], index[:, None, :]]  # (B, count, size, size)
    return blocks.reshape(-1, 1, *blocks.shape[-2:])


def _attend(call: AttentionCall, qkv: list[torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
    """One backend call over grouped rows: q (N, h, G, D), k/v (N, hkv, G, D) -> (N, G, h, D)."""
    q, k, v = qkv
    score = dataclasses.replace(call.score, q=q, k=k, key_positions=None, allowed=None)
    out, _ = dispatch(dataclasses.replace(call, score=score, v=v, mask=mask, want_weights=False))
    return out


def shifted_sparse_attention(call: AttentionCall, settings: ShiftedSparse) -> tuple[torch.Tensor, None]:
    """S2-Attn of one training call -> (output (B, T, Hq, D), None). See the module docstring."""
    refusal = s2_refusal(call.encoding)
    if refusal:  # patched with one that can, then reconfigured (e.g. RoPE to dynamic scaling)
        raise InvalidParameterError(refusal)
    q, k, v, mask = call.q, call.k, call.v, call.mask  # (B, Hq, T, D), (B, Hkv, Tk, D) x2, (B|1, 1, T, Tk)
    batch, heads, length, _ = q.shape
    if call.want_weights:
        raise InvalidParameterError(
            "S2-Attn: output_attentions is not allowed while training with S2-Attn (there is no (T, T) "
            "weight matrix); allowed: model.eval() (full attention) or hf_posenc.disable_s2_attn(model)"
        )
    if k.shape[-2] != length:
        raise InvalidParameterError(
            f"S2-Attn: a training forward with {k.shape[-2] - length} cached keys is not allowed (it groups whole "
            "sequences); allowed: model.eval() for generation, or a forward without past_key_values"
        )
    if heads % 2:
        raise InvalidParameterError(
            f"S2-Attn: {heads} attention heads is not allowed: half of them shift; allowed: an even head count"
        )
    if mask is not None and settings.wrap:
        raise InvalidParameterError(
            "S2-Attn: wrap=True (the paper's rolled groups) with an attention mask (padding, packed documents, "
            "a sliding window) is not allowed; allowed: wrap=False (LongLoRA's unrolled groups), which honours masks"
        )
    size = settings.group(length)
    count, half = length // size, size // 2
    kv_heads = k.shape[1]
    if kv_heads % 2:  # GQA with an odd KV head count: give every query head its own copy
        k, v = expand_kv_heads(k, heads // kv_heads), expand_kv_heads(v, heads // kv_heads)
        kv_heads = heads
    # query heads 0..Hq/2-1 read KV heads 0..Hkv/2-1 (core/layout.py: KV head g serves a run of heads)
    plain = (q[:, : heads // 2], k[:, : kv_heads // 2], v[:, : kv_heads // 2])  # (B, H/2, T, D)
    shifted = (q[:, heads // 2 :], k[:, kv_heads // 2 :], v[:, kv_heads // 2 :])
    tokens = torch.arange(length, device=q.device)

    def masks(*indices: torch.Tensor) -> torch.Tensor | None:
        if mask is None:
            return None
        return torch.cat([_group_mask(mask, batch, index) for index in indices])

    if settings.wrap:  # Algorithm 1: roll by -G/2, groups of G, roll back
        rolled = [x.roll(-half, dims=2) for x in shifted]
        grouped = [
            torch.cat((_group_rows(a, 0, count, size), _group_rows(b, 0, count, size)))
            for a, b in zip(plain, rolled, strict=True)
        ]
        out = _attend(call, grouped, None)  # (2*B*count, G, H/2, D)
        out = out.reshape(2, batch, length, heads // 2, -1)
        return torch.cat((out[0], out[1].roll(half, dims=1)), dim=2), None

    # unrolled: plain groups [mG, (m+1)G) and shifted interior groups [G/2 + mG, ...) in one call
    # (both are batches of (H/2, G) rows), the two shifted half-groups at the edges in another
    inner = count - 1
    groups = tokens.reshape(count, size)
    grouped = [
        torch.cat((_group_rows(a, 0, count, size), _group_rows(b, half, inner, size)))
        for a, b in zip(plain, shifted, strict=True)
    ]
    out = _attend(call, grouped, masks(groups, groups[:inner] + half))  # (B*(2*count-1), G, H/2, D)
    width = out.shape[-1]
    out_plain = out[: batch * count].reshape(batch, length, heads // 2, width)
    out_inner = out[batch * count :].reshape(batch, inner * size, heads // 2, width)  # (B, T-G, H/2, D)
    edges = [torch.cat((x[:, :, :half], x[:, :, length - half :])) for x in shifted]  # (2B, H/2, G/2, D)
    first, last = tokens[None, :half], tokens[None, length - half :]
    out_edges = _attend(call, edges, masks(first, last))  # (2B, G/2, H/2, D)
    out_shifted = torch.cat((out_edges[:batch], out_inner, out_edges[batch:]), dim=1)  # (B, T, H/2, D)
    return torch.cat((out_plain, out_shifted), dim=2), None
