"""What a patch request builds, before anything on the model changes: one encoding module per
part of its plan (a plain patch has one part covering every layer), the runtime that runs them,
which part serves each layer, and the ``config.posenc`` entry. :mod:`hf_posenc.core.patch`
installs it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..encodings.base import Encoding
from .config import EncodingConfig
from .hybrid import HybridEncoding, part_geometry, patch_module
from .interpolation import check_scaled_range
from .request import (  # noqa: F401  (MAPPING_KEYS, EncodingRequest, check_format_version: re-exported)
    MAPPING_KEYS,
    EncodingRequest,
    check_format_version,
    plan_request,
    saved_entry,
)
from .runtime import PartRuntime, PatchRuntime


@dataclasses.dataclass
class BuiltPatch:
    """What one patch installs, before anything on the model changes."""

    #: what ``model.posenc`` holds: the encoding of a one-part plan itself, or a
    #: :class:`HybridEncoding` of several parts
    module: Encoding | HybridEncoding
    #: the parts' encoding modules and resolved configs, in plan order
    parts: list[Encoding]
    configs: list[EncodingConfig]
    #: the part of every layer
    layers: list[int]
    runtime: PatchRuntime
    #: per layer: (its part's runtime, the layer's index as that part numbers it)
    layer_runtimes: list[tuple[PartRuntime, int]]
    #: the ``config.posenc`` entry
    entry: dict[str, Any]


def build_patch(
    target: nn.Module, adapter: Any, encoding: Any, params: Mapping[str, Any], backend: str
) -> BuiltPatch:
    """The encoding module(s), runtime and ``config.posenc`` entry of ``encoding`` for ``target``."""
    geometry = adapter.geometry(target.config)
    plan = plan_request(encoding, geometry.num_layers, params)
    parts: list[Encoding] = []
    configs: list[EncodingConfig] = []
    for index, (cls, config) in enumerate(plan.parts):
        own = part_geometry(geometry, plan.owned(index))
        configs.append(config.resolve(own))
        parts.append(cls(configs[-1], own))
        check_scaled_range(cls.name, parts[-1].scaled_range())
    runtimes = [PartRuntime(part, adapter, backend, token=uuid.uuid4().hex) for part in parts]
    layer_runtimes = [
        (runtimes[owner], plan.layers[:layer].count(owner)) for layer, owner in enumerate(plan.layers)
    ]
    return BuiltPatch(
        module=patch_module(parts, plan.layers),
        parts=parts,
        configs=configs,
        layers=list(plan.layers),
        runtime=PatchRuntime(runtimes, adapter.base_model(target)),
        layer_runtimes=layer_runtimes,
        entry=saved_entry([part.name for part in parts], configs, plan.layers),
    )
