"""What a patch request builds, before anything on the model changes: the encoding module (or a
hybrid's parts), the runtime that runs it, which runtime serves each layer, and the
``config.posenc`` entry. :mod:`hf_posenc.core.patch` installs it."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from torch import nn

from .._version import __version__
from ..encodings.base import Encoding
from .config import FORMAT_VERSION, HYBRID_FORMAT_VERSION, EncodingConfig
from .hybrid import HybridEncoding, part_geometry
from .request import (  # noqa: F401  (MAPPING_KEYS, EncodingRequest, check_format_version: re-exported)
    HYBRID,
    MAPPING_KEYS,
    EncodingRequest,
    PatchPlan,
    check_format_version,
    plan_request,
)
from .runtime import HybridRuntime, PatchRuntime


@dataclasses.dataclass
class BuiltPatch:
    """The encoding module(s) of one patch, before anything is installed on the model."""

    module: Encoding | HybridEncoding
    config: EncodingConfig
    runtime: PatchRuntime | HybridRuntime
    #: per layer: (runtime, the layer's index as the encoding numbers it)
    layers: list[tuple[PatchRuntime, int]]
    classes: list[type[Encoding]]
    entry: dict[str, Any]
    parts: list[EncodingConfig] | None = None


def _build_plain(
    target: nn.Module, adapter: Any, cls: type[Encoding], config: EncodingConfig, backend: str
) -> BuiltPatch:
    geometry = adapter.geometry(target.config)
    config = config.resolve(geometry)
    module = cls(config, geometry)
    base = adapter.base_model(target)
    runtime = PatchRuntime(module, adapter, base, backend, token=uuid.uuid4().hex)
    count = len(adapter.attention_modules(target))
    entry = {
        "encoding": cls.name,
        "params": config.to_dict(),
        "format_version": FORMAT_VERSION,
        "hf_posenc_version": __version__,
    }
    return BuiltPatch(module, config, runtime, [(runtime, i) for i in range(count)], [cls], entry)


def _build_hybrid(target: nn.Module, adapter: Any, plan: PatchPlan, backend: str) -> BuiltPatch:
    geometry = adapter.geometry(target.config)
    base = adapter.base_model(target)
    parts: list[Encoding] = []
    configs: list[EncodingConfig] = []
    for index, (cls, config) in enumerate(plan.parts):
        own = part_geometry(geometry, plan.owned(index))
        configs.append(config.resolve(own))
        parts.append(cls(configs[-1], own))
    module = HybridEncoding(parts, plan.layers)
    runtimes = [PatchRuntime(part, adapter, base, backend, token=uuid.uuid4().hex) for part in parts]
    layers = [(runtimes[owner], plan.layers[:layer].count(owner)) for layer, owner in enumerate(plan.layers)]
    entry = {
        "encoding": HYBRID,
        "params": {
            "parts": [
                {"encoding": type(part).name, "params": c.to_dict()}
                for part, c in zip(parts, configs, strict=True)
            ],
            "layers": list(plan.layers),
        },
        "format_version": HYBRID_FORMAT_VERSION,
        "hf_posenc_version": __version__,
    }
    classes = [type(part) for part in parts]
    return BuiltPatch(module, configs[0], HybridRuntime(runtimes, base), layers, classes, entry, configs)


def build_patch(
    target: nn.Module, adapter: Any, encoding: Any, params: Mapping[str, Any], backend: str
) -> BuiltPatch:
    """The encoding module(s), runtime and ``config.posenc`` entry of ``encoding`` for ``target``."""
    plan = plan_request(encoding, adapter.geometry(target.config).num_layers, params)
    if len(plan.parts) == 1:  # every layer runs the same encoding: the plain patch
        cls, config = plan.parts[0]
        return _build_plain(target, adapter, cls, config, backend)
    return _build_hybrid(target, adapter, plan, backend)
