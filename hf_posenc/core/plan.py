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
from ..errors import InvalidParameterError
from .config import FORMAT_VERSION, HYBRID_FORMAT_VERSION, EncodingConfig
from .hybrid import HYBRID, HybridEncoding, HybridPlan, is_hybrid_request, part_geometry, plan_hybrid
from .registry import get_encoding
from .runtime import HybridRuntime, PatchRuntime

#: keys of the mapping form (what ``config.posenc`` holds)
MAPPING_KEYS = ("encoding", "params", "format_version", "hf_posenc_version")


#: what ``patch_model`` accepts as ``encoding``: one encoding, or a per-layer hybrid
EncodingRequest = str | EncodingConfig | Mapping[Any, Any] | list[Any] | tuple[Any, ...]


def _check_mapping(encoding: Mapping[str, Any]) -> None:
    unknown = sorted(set(encoding) - set(MAPPING_KEYS))
    if unknown:
        raise InvalidParameterError(
            f"the encoding mapping has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(map(repr, MAPPING_KEYS))}"
        )
    name = encoding.get("encoding")
    if not isinstance(name, str):
        raise InvalidParameterError(
            f"the encoding mapping needs 'encoding': an encoding name (str), got {name!r}"
        )
    params = encoding.get("params", {})
    if params is None or not isinstance(params, Mapping):
        raise InvalidParameterError(
            f"the encoding mapping's 'params' must be a mapping of parameter names to values, got {params!r}"
        )
    if "format_version" in encoding:
        check_format_version(encoding["format_version"])


def check_format_version(version: Any) -> None:
    """Raise for a ``config.posenc`` written in a format this version cannot read."""
    newest = max(FORMAT_VERSION, HYBRID_FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= newest:
        raise InvalidParameterError(
            f"config.posenc format_version={version!r} is not supported; allowed: "
            f"{', '.join(str(v) for v in range(1, newest + 1))} (written by hf_posenc <= {__version__}; "
            "a newer hf_posenc may be needed)"
        )


def _encoding_config(encoding: Any, params: Mapping[str, Any]) -> tuple[type[Encoding], EncodingConfig]:
    if isinstance(encoding, EncodingConfig):
        if params:
            raise InvalidParameterError(
                f"pass parameters inside the config object or as keywords, not both (got {sorted(params)})"
            )
        return get_encoding(encoding.encoding), encoding
    if isinstance(encoding, Mapping):  # the serialised form stored in config.posenc
        if params:
            raise InvalidParameterError("pass parameters inside the mapping or as keywords, not both")
        _check_mapping(encoding)
        cls = get_encoding(encoding["encoding"])
        return cls, cls.config_class.from_params(encoding.get("params", {}))
    if not isinstance(encoding, str):
        raise InvalidParameterError(
            f"encoding must be a name, an EncodingConfig or a mapping, got {type(encoding).__name__}"
        )
    cls = get_encoding(encoding)
    return cls, cls.config_class.from_params(params)


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


def _build_hybrid(target: nn.Module, adapter: Any, plan: HybridPlan, backend: str) -> BuiltPatch:
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
    if is_hybrid_request(encoding):
        if isinstance(encoding, Mapping) and encoding.get("encoding") == HYBRID:
            _check_mapping(encoding)  # the serialised form: keys, params, format version
        plan = plan_hybrid(encoding, adapter.geometry(target.config).num_layers, params)
        if len(plan.parts) == 1:  # every layer runs the same encoding: the plain patch
            cls, config = plan.parts[0]
            return _build_plain(target, adapter, cls, config, backend)
        return _build_hybrid(target, adapter, plan, backend)
    cls, config = _encoding_config(encoding, params)
    return _build_plain(target, adapter, cls, config, backend)
