"""The typed call objects every encoding stage receives (immutable: a stage never sees another's edits).

    ForwardCall   positions of one forward, its memo and N-D coordinates      -> ``embed``
    LayerCall     + the layer, its input and its decoding state               -> ``layer_input``,
                                                                                 ``adjust_qkv``, ``rotate``,
                                                                                 ``adjust_output``
    ScoreCall     + queries and keys as attended (after rotation and the      -> ``logits``, ``score_bias``,
                  cache update), key positions and the mask                     ``transform_scores``,
                                                                                 ``normalize``

:class:`NeighbourSplit` is what an encoding with two position maps (near keys / far keys:
SelfExtend, ReRoPE) gives the block backend instead of scores (``Encoding.neighbour_split``).

A narrower view is derived with :meth:`ScoreCall.rows` or :meth:`ScoreCall.with_allowed`,
which return new objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.layout import causal_keys
from ..core.memo import ForwardMemo


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardCall:
    positions: torch.Tensor  # (B, Tq) absolute positions of the new tokens (padding-aware)
    memo: ForwardMemo
    #: (B|1, Tq, axes) N-D positions the caller passed as ``position_coordinates``; None otherwise
    coordinates: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCall(ForwardCall):
    layer_idx: int
    hidden: torch.Tensor  # (B, Tq, hidden) the layer's input
    state: dict[str, Any] | None = None  # this layer's decoding state; None without a KV cache

    def with_attention(
        self, q: torch.Tensor, k: torch.Tensor, key_positions: torch.Tensor | None = None
    ) -> ScoreCall:
        """This call widened by the queries and keys as attended (and the keys' positions)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return ScoreCall(**fields, q=q, k=k, key_positions=key_positions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreCall(LayerCall):
    q: torch.Tensor  # (B, Hq, Tq, D) queries as attended
    k: torch.Tensor  # (B, Hkv, Tk, D) keys as attended (cached ones included)
    #: (B, Tk) absolute positions of the keys; only for encodings with a ``logits`` stage
    key_positions: torch.Tensor | None = None
    #: which keys each query may attend, (B|1, 1, Tq, Tk) bool (True = may attend), given to
    #: ``transform_scores`` / ``normalize``; None there means every key is allowed (one decoding
    #: query without padding)
    allowed: torch.Tensor | None = None

    @property
    def q_len(self) -> int:
        return self.q.shape[-2]

    @property
    def k_len(self) -> int:
        return self.k.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def with_allowed(self, allowed: torch.Tensor | None) -> ScoreCall:
        return dataclasses.replace(self, allowed=allowed)

    def rows(self, start: int, stop: int, k_start: int = 0) -> ScoreCall:
        """The call of queries ``start .. stop-1`` with the keys ``k_start ..`` they may attend
        (bottom-right aligned: the keys past the block's last query are dropped, so query
        ``start + a`` stays aligned with key ``Tk - Tq + start + a``). ``k_start`` > 0 drops
        leading keys none of the queries may attend (earlier packed documents, left padding).

        Such a call gets its own memo: entries are keyed by shape (e.g. FIRE's query positions),
        and two blocks with skipped keys can share (rows, keys) while their positions differ."""
        k_end = causal_keys(self.q_len, self.k_len, stop)
        keys = slice(k_start, k_end)
        return dataclasses.replace(
            self,
            memo=self.memo if k_start == 0 else ForwardMemo(),
            q=self.q[:, :, start:stop],
            k=self.k[:, :, keys],
            hidden=self.hidden[:, start:stop],
            positions=self.positions[:, start:stop],
            key_positions=None if self.key_positions is None else self.key_positions[:, keys],
            allowed=None if self.allowed is None else self.allowed[..., start:stop, keys],
        )


@dataclasses.dataclass(frozen=True)
class NeighbourSplit:
    """One attention call's queries and keys rotated under both position maps.

    ``near_q``/``far_q`` (B, Hq, Tq, D), ``near_k``/``far_k`` (B, Hkv, Tk, D); a key j is a
    neighbour of query i when ``q_positions[i] - k_positions[j] < window``."""

    window: int
    near_q: torch.Tensor
    near_k: torch.Tensor
    far_q: torch.Tensor
    far_k: torch.Tensor
    q_positions: torch.Tensor  # (B, Tq)
    k_positions: torch.Tensor  # (B, Tk)

    def is_near(self, q_slice: slice, k_slice: slice) -> torch.Tensor:
        """(B, 1, rows, keys) bool: True where the key is a neighbour of the query."""
        # q - k < window as k > q - window: one bool (rows, keys) tensor, no int64 distances
        return (self.k_positions[:, None, k_slice] > self.q_positions[:, q_slice, None] - self.window)[
            :, None
        ]
