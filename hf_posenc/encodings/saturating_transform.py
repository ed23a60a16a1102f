"""A ``transform_scores`` stage that becomes a per-query constant past a point of each row: the
form an encoding gives so that a backend may attend the far keys with a fused kernel.

For a causal row of query i (keys j <= i) with scaled logits ``S_ij = scale * q_i . k_j``, a
saturating transform T satisfies, for some key ``f_i`` (found by the backend from the band):

    T(S)_ij = S_ij + tail_i      for every key j < f_i       (and the gradient of T(S)_ij with
                                                              respect to the band's S is 0 there)

so the far keys' softmax is plain attention shifted by the constant ``tail_i`` and only a band of
keys near the query needs the explicit transform. CoPE (Golovneva et al., 2024) is one: its
contextual position ``p_ij = min(sum_{t=j}^{i} g_it, npos_max - 1)`` stops at ``npos_max - 1`` once
the gates summed from the query back reach it, and from there on its logit is
``S_ij + scale * q_i . e[npos_max - 1]``.

A form answers, for a block of queries and a band of their keys (the band's first key the same
for every row of the block):

- :meth:`band`: the transformed logits of the band (differentiable in the queries, the band's
  scores and the form's tensors) and, per row, whether every key before the band is saturated;
- :meth:`tail`: ``tail_i`` of the rows (differentiable in the queries and the form's tensors).

Its tensors (:meth:`tensors`, rebuilt with :meth:`replace`) are the parameters its formulas read,
so a backend's backward can ask autograd for their gradients.
"""

from __future__ import annotations

import abc
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SaturatingTransform(abc.ABC):
    """See the module docstring."""

    @abc.abstractmethod
    def band(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, Hq, R, D) the block's queries, ``scores`` (B, Hq, R, K) their scaled logits over the
        band's K keys, ``allowed`` (R, K) bool (the causal mask inside the band) -> (transformed
        logits (B, Hq, R, K), masked entries arbitrary; saturated (B, Hq, R) bool: every key
        before the band has the tail form, with a margin that holds for any summation order)."""

    @abc.abstractmethod
    def tail(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, R, D) -> tail_i (B, Hq, R), in q's dtype."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields, by name (the parameters its formulas read)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }

    def replace(self, **tensors: torch.Tensor) -> SaturatingTransform:
        """A copy with some tensor fields replaced (e.g. by leaves that collect gradients)."""
        return dataclasses.replace(self, **tensors)
