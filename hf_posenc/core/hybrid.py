"""A per-layer hybrid's encoding module: one patch, a different encoding in different layers.

SmolLM3 and Llama 4 ship "NoPE every 4th layer": ``patch_model(model, ["rope", "rope", "rope",
"nope"])``. What a request means (the accepted forms, equal entries sharing one part, what may be
mixed) is worked out in :mod:`hf_posenc.core.request`; this module holds what is installed for a
plan of several parts: :class:`HybridEncoding` (``model.posenc``, the parts and the layer each
runs in) and :func:`part_geometry`.

Each part is built for the layers it owns (its :class:`~hf_posenc.models.base.ModelGeometry` lists
only those, in order, and it sees them as layers ``0..n-1``), so per-layer tensors exist only for
its own layers; its tensors are saved under ``posenc.parts.<i>.``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ..encodings.base import Encoding
from ..models.base import ModelGeometry
from .config import HYBRID_FORMAT_VERSION
from .request import (  # noqa: F401  (the request language lived here before; old imports keep working)
    DEFAULT_KEY,
    HYBRID,
    PART_KEYS,
    HybridPlan,
    canonical_request,
    check_mixable,
    check_request,
    entry_config,
    is_hybrid_request,
    is_pattern_text,
    matches_saved,
    mixable,
    parse_pattern_text,
    pattern_text,
    plan_hybrid,
    saved_description,
)

__all__ = ["HYBRID", "HYBRID_FORMAT_VERSION", "HybridEncoding", "HybridPlan", "plan_hybrid"]


def part_geometry(geometry: ModelGeometry, layers: Sequence[int]) -> ModelGeometry:
    """The geometry a part sees: only the layers it owns, renumbered ``0..len(layers)-1`` (a part
    that owns every layer, as a plain patch's does, sees the model's own geometry)."""
    if list(layers) == list(range(geometry.num_layers)):
        return geometry
    own = tuple(geometry.layer(index) for index in layers) if geometry.layers else ()
    return dataclasses.replace(geometry, num_layers=len(layers), layers=own)


class HybridEncoding(nn.Module):
    """``model.posenc`` of a hybrid patch: the parts (one :class:`Encoding` each) and the layers
    each runs in. Tensors are saved as ``posenc.parts.<i>.<name>``."""

    name = HYBRID

    def __init__(self, parts: Sequence[Encoding], layers: Sequence[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        #: part index of every layer
        self.layers = list(layers)

    def encodings(self) -> list[Encoding]:
        """The parts as encodings (``nn.ModuleList`` iterates as plain modules for the type checker)."""
        return [cast(Encoding, part) for part in self.parts]

    def owned(self, part: int) -> list[int]:
        return [layer for layer, owner in enumerate(self.layers) if owner == part]

    def initialise_from_model(self, model: nn.Module, adapter: Any) -> None:
        for part in self.encodings():
            part.initialise_from_model(model, adapter)

    @torch.no_grad()
    def reset_parameters(self, keep_loaded: bool = False) -> list[str]:
        reset: list[str] = []
        for index, part in enumerate(self.encodings()):
            reset.extend(f"parts.{index}.{name}" for name in part.reset_parameters(keep_loaded=keep_loaded))
        return reset

    def describe(self) -> str:
        """The per-layer text form (``rope*3+nope+rope*3+nope``)."""
        names = [part.name for part in self.encodings()]
        return pattern_text([names[owner] for owner in self.layers])

    def extra_repr(self) -> str:
        return f"layers={self.describe()!r}"


def patch_module(parts: Sequence[Encoding], layers: Sequence[int]) -> Encoding | HybridEncoding:
    """What ``model.posenc`` holds for a plan's parts: the encoding itself when there is one (its
    tensors saved as ``posenc.<name>``, as every version wrote a plain patch), a
    :class:`HybridEncoding` of them when there are several (``posenc.parts.<i>.<name>``)."""
    if len(parts) == 1:
        return parts[0]
    return HybridEncoding(parts, layers)
