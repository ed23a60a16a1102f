"""Explicit score stages that need only a band of keys near each query, past which a row is
either a plain logit plus a per-query constant (:class:`SaturatingTransform`) or has weights
that are exactly zero (:class:`VanishingWeights`): the forms an encoding gives so that a backend
(:mod:`hf_posenc.attention.saturating_band`) computes the band explicitly and the rest with a
fused kernel, or not at all.

A form answers, for a block of queries and a band of their keys (the band's first key the same
for every row of the block; ``allowed`` the causal mask inside it, ``own`` each query's own key):
:meth:`BandForm.band` gives the band's values (differentiable in the queries, the band's scores
and the form's tensors) and, per row, whether every key before the band has the far form. Its
tensors (:meth:`BandForm.tensors`, rebuilt with :meth:`BandForm.replace`) are the parameters its
formulas read, so a backend's backward can ask autograd for their gradients.

**Saturating transform** (a ``transform_scores`` stage): for the scaled logits
``S_ij = scale * q_i . k_j`` of a causal row, ``T(S)_ij = S_ij + tail_i`` for every key ``j`` before
the band, and the gradient of ``T(S)_ij`` with respect to the band's S is 0 there; so the far
keys' softmax is plain attention shifted by the constant ``tail_i``. CoPE (Golovneva et al., 2024)
is one: its contextual position ``p_ij = min(sum_{t=j}^{i} g_it, npos_max - 1)`` stops at
``npos_max - 1`` once the gates summed from the query back reach it, and from there on its logit
is ``S_ij + scale * q_i . e[npos_max - 1]``.

**Vanishing weights** (a ``normalize`` stage): the weights of every key before the band are
exactly 0, with zero gradient, in the eager computation itself. Stick-breaking attention (Tan et
al., 2024) is one: ``log A_ij = log sigmoid(z_ij) + sum_{t > j} log sigmoid(-z_it)`` only falls as
j moves back from the query, and its weights are flushed to 0 below fp32's smallest normal number
(``core.underflow.exp_flushed``), so once the band's sum of ``log sigmoid(-z)`` passes that
bound every earlier key's weight is 0.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch

FormT = TypeVar("FormT", bound="BandForm")


@dataclasses.dataclass(frozen=True)
class BandForm(abc.ABC):
    """See the module docstring."""

    @abc.abstractmethod
    def band(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, Hq, R, D) the block's queries, ``scores`` (B, Hq, R, K) their scaled logits over the
        band's K keys, ``allowed`` (R, K) bool (the causal mask inside the band), ``own`` (R, K)
        bool (each query's own key) -> (the band's values (B, Hq, R, K): transformed logits or
        weights; done (B, Hq, R) bool: every key before the band has the far form, with a margin
        that holds for any summation order)."""

    #: whether :meth:`band_with_gradients` is written (else the backend asks autograd)
    backward_by_hand: ClassVar[bool] = False

    def band_with_gradients(
        self, q: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, own: torch.Tensor
    ) -> tuple[torch.Tensor, BandBackward]:
        """For forms whose band's backward is written by hand (:data:`backward_by_hand`): the
        band's values, as :meth:`band` gives them (without its flag), and a function of their
        gradient (B, Hq, R, K), 0 on the keys ``allowed`` forbids, and a saturating transform's
        tail's gradient (B, Hq, R) or None -> (dS (B, Hq, R, K), the gradient of q (B, Hq, R, D)
        through the form's own use of it or None, the form's tensors' gradients by name)."""
        raise NotImplementedError(f"{type(self).__name__} has no band backward by hand")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields, by name (the parameters its formulas read)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), torch.Tensor)
        }

    def replace(self: FormT, **tensors: torch.Tensor) -> FormT:
        """A copy with some tensor fields replaced (e.g. by leaves that collect gradients)."""
        return dataclasses.replace(self, **tensors)


@dataclasses.dataclass(frozen=True)
class SaturatingTransform(BandForm):
    """A ``transform_scores`` stage whose far keys have the logit plus ``tail`` (module docstring);
    :meth:`band` gives transformed logits, -inf on the keys ``allowed`` forbids."""

    @abc.abstractmethod
    def tail(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, R, D) -> tail_i (B, Hq, R), in q's dtype."""


#: a hand-written band backward (:meth:`BandForm.band_with_gradients`)
BandBackward = Callable[
    [torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]"
]


@dataclasses.dataclass(frozen=True)
class VanishingWeights(BandForm):
    """A ``normalize`` stage whose far keys have weight 0 (module docstring); :meth:`band` gives
    the band's attention weights (0 on masked keys)."""
