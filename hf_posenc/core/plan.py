"""What a patch request builds, before anything on the model changes: one encoding module per
part of its plan (a plain patch has one part covering every layer), the runtime that runs them,
which part serves each layer, and the ``config.posenc`` entry. :mod:`hf_posenc.core.patch`
installs it."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..encodings.base import Encoding
from ..errors import UnsupportedModelError
from .config import EncodingConfig
from .hybrid import HybridEncoding, part_geometry, patch_module
from .interpolation import check_scaled_range
from .registry import adapter_for_config, supported_families
from .request import (  # noqa: F401  (MAPPING_KEYS, EncodingRequest, check_format_version: re-exported)
    MAPPING_KEYS,
    EncodingRequest,
    PatchPlan,
    check_format_version,
    plan_request,
    plan_saved,
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
    parts, configs = _built_parts(plan, geometry)
    _check_ranges(parts)
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


def _built_parts(plan: PatchPlan, geometry: Any) -> tuple[list[Encoding], list[EncodingConfig]]:
    """Each part of ``plan`` resolved against the layers it owns and built."""
    parts: list[Encoding] = []
    configs: list[EncodingConfig] = []
    for index, (cls, config) in enumerate(plan.parts):
        own = part_geometry(geometry, plan.owned(index))
        configs.append(config.resolve(own))
        parts.append(cls(configs[-1], own))
    return parts, configs


def _check_ranges(parts: list[Encoding]) -> None:
    """Refuse a linear factor whose scaled positions leave the dtype (one line with the bound)."""
    for part in parts:
        check_scaled_range(part.name, part.scaled_range())


def check_patch_fits(
    model_config: Any,
    encoding: Any = None,
    params: Mapping[str, Any] | None = None,
) -> int | None:
    """Everything :func:`build_patch` would refuse that the model's config alone decides, without
    the model's weights: a pattern longer than the depth, a parameter its layers cannot resolve, a
    scaling whose positions leave the dtype. ``encoding`` None: the checkpoint's own saved
    ``config.posenc`` with ``params`` as overrides (what ``from_pretrained`` / ``load_model``
    would rebuild). The recipes run it before they read data or load a model, so a bad request
    costs one line, not a tokenisation pass. The parts are built on the meta device (no memory,
    no initialisation). A config no family serves is refused as :func:`patch_model` would.
    Returns how many parameter elements the encoding's parts would have (0: it learns nothing),
    or None where there is nothing to patch (no ``encoding`` and nothing saved)."""
    saved: Mapping[str, Any] = getattr(model_config, "posenc", None) or {}
    if encoding is None and not saved:
        return None
    adapter = adapter_for_config(model_config)
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {getattr(model_config, 'model_type', None)!r} is not supported; "
            f"supported families: {', '.join(supported_families())}"
        )
    geometry = adapter.geometry(model_config)
    if encoding is not None:
        plan = plan_request(encoding, geometry.num_layers, params)
    else:
        plan = plan_saved(saved, params, geometry.num_layers)
    return check_planned_parts(plan, geometry, initial_values=encoding is not None)


#: parts with at most this many tensor elements in all are built a second time on the CPU, so
#: the checks that read their initial values run too (a fresh patch only: a saved checkpoint's
#: tensors are not its initial values)
VALUE_CHECK_ELEMENTS = 1 << 22


def check_planned_parts(plan: PatchPlan, geometry: Any, *, initial_values: bool = False) -> int:
    """:func:`build_patch`'s checks of each part of ``plan`` on a model of ``geometry``, with the
    parts built on the meta device (no memory, no initialisation). ``initial_values``: the parts
    will start from their initial values (a fresh patch), so where they are small
    (:data:`VALUE_CHECK_ELEMENTS`) they are built again on the CPU and the checks that read
    those values run as well (comrope's and liere's bound on the scaled generators). Returns the
    elements of the parts' parameters (0 for an encoding that learns nothing)."""
    # built apart from the caller's random stream: a check must not change what a seed gives
    with torch.random.fork_rng(devices=[]):
        with torch.device("meta"):
            parts, _ = _built_parts(plan, geometry)
        elements = sum(
            t.numel() for part in parts for t in itertools.chain(part.parameters(), part.buffers())
        )
        if initial_values and elements <= VALUE_CHECK_ELEMENTS:
            with torch.device("cpu"):
                parts, _ = _built_parts(plan, geometry)
        _check_ranges(parts)
    return sum(p.numel() for part in parts for p in part.parameters())
