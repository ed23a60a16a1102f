"""The request language: everything ``patch_model`` (and the recipes) accept as an encoding,
turned into a :class:`PatchPlan` before anything on the model changes.

A plan is the distinct encodings (*parts*: class and unresolved config, in order of their first
layer) and, for every layer, the part that runs there. A plain patch is a plan with one part that
covers every layer.

Accepted forms:

- one encoding: a name or alias (``"rope"``), an :class:`~hf_posenc.core.config.EncodingConfig`,
  or the mapping stored in ``config.posenc`` (``{"encoding": "alibi", "params": {...}}``), with
  ``params`` (keywords of ``patch_model``) as its parameters;
- a per-layer hybrid, every entry being a name, a config object, a ``(name, params)`` pair or the
  ``{"encoding": ..., "params": ...}`` mapping:

  - a list: a pattern repeated over the depth (one longer than the depth is refused: its entries
    past the last layer would run nowhere);
  - a mapping of layer indices to entries, with ``"default"`` for the layers not named:
    ``{"default": "rope", 3: "nope", 7: "nope"}`` (the explicit layer -> encoding form);
  - the text form used by the recipes: entries joined by ``+``, ``NAME*N`` repeating one N times:
    ``"rope*3+nope"`` (a pattern, as a list);
  - the serialised form stored in ``config.posenc`` (``{"encoding": "hybrid", "params": {"parts":
    [...], "layers": [...]}}``).

Equal entries (same encoding, same parameters) form one part that owns all their layers and shares
its tensors across them. Encodings that cannot run in some layers only
(:meth:`~hf_posenc.encodings.base.Encoding.mixing_refusal`) are refused when a plan mixes encodings.

The request language is this module and two beside it: :mod:`hf_posenc.core.pattern` (the text
form: parsing and writing ``"rope*3+nope"``, :func:`canonical_request`) and
:mod:`hf_posenc.core.saved_form` (the ``config.posenc`` entry: writing it, checking its keys and
format version, describing it, :func:`matches_saved`). Their names are importable from here too,
as before. The recipes' checks without a model (:func:`check_request`, :func:`check_overrides`)
need a plan and live here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..encodings.base import Encoding
from ..errors import InvalidParameterError
from .config import EncodingConfig, PositionLimit
from .pattern import (  # noqa: F401  (the text form: importable from here as before)
    canonical_request,
    expand_runs,
    is_pattern_text,
    parse_pattern_runs,
    parse_pattern_text,
    pattern_text,
)
from .registry import get_encoding
from .saved_form import (  # noqa: F401  (the saved form: importable from here as before)
    HYBRID,
    HYBRID_KEYS,
    MAPPING_KEYS,
    PART_KEYS,
    check_format_version,
    check_mapping,
    check_saved_entry,
    describe_patch,
    matches_saved,
    saved_description,
    saved_entry,
)

#: the key of the explicit form naming the encoding of every layer not listed
DEFAULT_KEY = "default"

#: what ``patch_model`` accepts as ``encoding``: one encoding, or a per-layer hybrid
EncodingRequest = str | EncodingConfig | Mapping[Any, Any] | list[Any] | tuple[Any, ...]


@dataclasses.dataclass
class PatchPlan:
    """Distinct encodings (``parts``: class and unresolved config) and the part of every layer."""

    parts: list[tuple[type[Encoding], EncodingConfig]]
    layers: list[int]

    def owned(self, part: int) -> list[int]:
        """The layers ``part`` runs in, in order."""
        return [layer for layer, owner in enumerate(self.layers) if owner == part]

    def position_limit(self, geometry: Any) -> PositionLimit | None:
        """The shortest limit of its parts on a model of ``geometry`` (None: any length works)."""
        limits = [limit for _, config in self.parts if (limit := config.position_limit(geometry)) is not None]
        return min(limits, key=lambda limit: limit.tokens) if limits else None


#: the name this plan had when only hybrids were planned
HybridPlan = PatchPlan


def plan_request(encoding: Any, num_layers: int, params: Mapping[str, Any] | None = None) -> PatchPlan:
    """The plan of ``patch_model(model, encoding, **params)`` for a model with ``num_layers`` layers."""
    if is_hybrid_request(encoding):
        if isinstance(encoding, Mapping) and encoding.get("encoding") == HYBRID:
            check_mapping(encoding)  # the serialised form: keys, params, format version
        return plan_hybrid(encoding, num_layers, params)
    cls, config = _encoding_config(encoding, params or {})
    return PatchPlan([(cls, config)], [0] * num_layers)


def plan_saved(saved: Mapping[str, Any], overrides: Mapping[str, Any] | None, num_layers: int) -> PatchPlan:
    """The plan of a saved ``config.posenc`` entry with ``overrides`` of its parameters (what
    ``from_pretrained(..., encoding_overrides=overrides)`` runs)."""
    if saved.get("encoding") == HYBRID:
        return plan_hybrid(saved, num_layers, overrides)
    params = {**dict(saved.get("params") or {}), **dict(overrides or {})}
    return plan_request({**saved, "params": params}, num_layers)


# -- one encoding ------------------------------------------------------------------------------------
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
        check_mapping(encoding)
        cls = get_encoding(encoding["encoding"])
        return cls, cls.config_class.from_params(encoding.get("params", {}))
    if not isinstance(encoding, str):
        raise InvalidParameterError(
            f"encoding must be a name, an EncodingConfig or a mapping, got {type(encoding).__name__}"
        )
    cls = get_encoding(encoding)
    return cls, cls.config_class.from_params(params)


# -- per-layer hybrids -------------------------------------------------------------------------------
def _is_pair(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], Mapping)
    )


def is_hybrid_request(encoding: Any) -> bool:
    """Whether ``patch_model``'s ``encoding`` takes the per-layer route (any form above, or one
    ``(name, params)`` pair); a plan whose layers all run one encoding becomes the plain patch."""
    if is_pattern_text(encoding) or isinstance(encoding, (list, tuple)):
        return True  # a (name, params) pair is one entry: every layer, i.e. the plain patch
    if isinstance(encoding, Mapping):
        if encoding.get("encoding") == HYBRID:
            return True
        # a mapping keyed by layers (or with "default"); keys that are neither are refused there
        return (
            bool(encoding)
            and "encoding" not in encoding
            and any(key == DEFAULT_KEY or not isinstance(key, str) for key in encoding)
        )
    return False


def entry_config(entry: Any) -> tuple[type[Encoding], EncodingConfig]:
    """One entry (name, config object, ``(name, params)`` or mapping) -> (class, config)."""
    if isinstance(entry, EncodingConfig):
        return get_encoding(entry.encoding), entry
    if isinstance(entry, str):
        cls = get_encoding(entry)
        return cls, cls.config_class.from_params({})
    if _is_pair(entry) or (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
        cls = get_encoding(entry[0])
        return cls, cls.config_class.from_params(dict(entry[1] or {}))
    if isinstance(entry, Mapping) and isinstance(entry.get("encoding"), str):
        unknown = sorted(set(entry) - set(PART_KEYS) - {"format_version", "hf_posenc_version"})
        if unknown:
            raise InvalidParameterError(
                f"hybrid entry {dict(entry)!r} has unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed keys: {', '.join(map(repr, PART_KEYS))}"
            )
        cls = get_encoding(entry["encoding"])
        return cls, cls.config_class.from_params(dict(entry.get("params") or {}))
    raise InvalidParameterError(
        f"hybrid entry {entry!r} is not allowed; allowed: an encoding name, an encoding config object, "
        "a (name, params) pair or a {'encoding': name, 'params': {...}} mapping"
    )


def _per_layer_entries(encoding: Any, num_layers: int) -> list[Any]:
    if _is_pair(encoding):
        return [encoding] * num_layers
    if is_pattern_text(encoding) or isinstance(encoding, (list, tuple)):
        runs = (
            parse_pattern_runs(encoding) if isinstance(encoding, str) else [(entry, 1) for entry in encoding]
        )
        if not runs:
            raise InvalidParameterError("an encoding pattern needs at least one entry; got an empty list")
        length = sum(count for _, count in runs)
        if length > num_layers:
            raise InvalidParameterError(
                f"encoding pattern {_shown(encoding)} has {length} entries but the model has {num_layers} "
                f"layer(s), so entries past layer {num_layers - 1} would run nowhere; allowed: a pattern of at "
                f"most {num_layers} entries (it repeats over the depth), or a per-layer mapping"
            )
        period = expand_runs(runs, length)
        return [period[layer % length] for layer in range(num_layers)]
    assert isinstance(encoding, Mapping)
    bad = [
        key for key in encoding if key != DEFAULT_KEY and (isinstance(key, bool) or not isinstance(key, int))
    ]
    if bad:
        raise InvalidParameterError(
            f"per-layer encodings: key {bad[0]!r} is not allowed; allowed keys: layer indices (int, "
            f"0 .. {num_layers - 1}) and {DEFAULT_KEY!r}"
        )
    layers = {key: value for key, value in encoding.items() if key != DEFAULT_KEY}
    outside = sorted(layer for layer in layers if not 0 <= layer < num_layers)
    if outside:
        raise InvalidParameterError(
            f"per-layer encodings name layer(s) {outside}; allowed: 0 .. {num_layers - 1} (the model has "
            f"{num_layers} layers)"
        )
    missing = [layer for layer in range(num_layers) if layer not in layers]
    if missing and DEFAULT_KEY not in encoding:
        raise InvalidParameterError(
            f"per-layer encodings leave layer(s) {missing} without an encoding; name them or add "
            f"{DEFAULT_KEY!r}: NAME for the layers not listed"
        )
    return [layers.get(layer, encoding.get(DEFAULT_KEY)) for layer in range(num_layers)]


def _shown(encoding: Any) -> str:
    """A pattern as a message quotes it: the text, or the list (long ones cut)."""
    text = repr(encoding)
    return text if len(text) <= 120 else text[:117] + "..."


def _serialised_parts(
    encoding: Mapping[str, Any], num_layers: int
) -> tuple[list[tuple[type[Encoding], EncodingConfig]], list[int]]:
    """The parts and layers a hybrid ``config.posenc`` lists, as written: never merged, so a saved
    model's tensors (``posenc.parts.<i>.``) are exactly what its plan expects, even when
    ``reconfigure`` made two parts' parameters equal."""
    params = encoding.get("params")
    parts = params.get("parts") if isinstance(params, Mapping) else None
    layers = params.get("layers") if isinstance(params, Mapping) else None
    if not isinstance(parts, list) or not isinstance(layers, list):
        raise InvalidParameterError(
            "a hybrid config.posenc needs params {'parts': [{'encoding': ..., 'params': ...}, ...], "
            f"'layers': [part index per layer]}}; got {params!r}"
        )
    assert isinstance(params, Mapping)
    unknown = sorted(set(params) - set(HYBRID_KEYS), key=repr)
    if unknown:
        raise InvalidParameterError(
            f"a hybrid config.posenc's params have unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(map(repr, HYBRID_KEYS))}"
        )
    if len(layers) != num_layers or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(parts) for i in layers
    ):
        raise InvalidParameterError(
            f"a hybrid config.posenc's 'layers' must give one part index (0 .. {len(parts) - 1}) per layer "
            f"of the model ({num_layers}); got {layers!r}"
        )
    idle = [index for index in range(len(parts)) if index not in layers]
    if idle:
        raise InvalidParameterError(
            f"a hybrid config.posenc lists part(s) {idle} that no layer runs (layers {layers!r}); allowed: "
            "every part runs in at least one layer"
        )
    return [entry_config(part) for part in parts], list(layers)


def _with_shared_params(
    entry: tuple[type[Encoding], EncodingConfig], params: Mapping[str, Any]
) -> tuple[type[Encoding], EncodingConfig]:
    cls, config = entry
    own = {k: v for k, v in params.items() if k in cls.config_class.parameter_names()}
    if not own:
        return entry
    return cls, cls.config_class.from_params({**config.to_dict(), **own})


def _merge_equal(
    entries: list[tuple[type[Encoding], EncodingConfig]], layers: list[int]
) -> list[tuple[type[Encoding], EncodingConfig]]:
    """One part per distinct (class, parameters), in order of first layer; ``layers`` gets the part
    of every entry."""
    parts: list[tuple[type[Encoding], EncodingConfig]] = []
    for cls, config in entries:
        index = next(
            (i for i, (c, k) in enumerate(parts) if c is cls and k.to_dict() == config.to_dict()), None
        )
        if index is None:
            index = len(parts)
            parts.append((cls, config))
        layers.append(index)
    return parts


def plan_hybrid(encoding: Any, num_layers: int, params: Mapping[str, Any] | None = None) -> PatchPlan:
    """The plan of a hybrid request for a model with ``num_layers`` layers.

    ``params`` (keywords of ``patch_model``) go to every entry whose encoding has that parameter;
    one that no entry has is refused. Embed-stage and cross-layer encodings are refused when the
    plan mixes encodings. The saved form keeps the parts it lists; other forms merge equal entries."""
    saved = isinstance(encoding, Mapping) and encoding.get("encoding") == HYBRID
    if saved:
        entries, layers = _serialised_parts(encoding, num_layers)
    else:
        entries, layers = [entry_config(entry) for entry in _per_layer_entries(encoding, num_layers)], []
    params = dict(params or {})
    if params:
        known = {name for cls, _ in entries for name in cls.config_class.parameter_names()}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidParameterError(
                f"no encoding of the pattern has parameter(s) {', '.join(map(repr, unknown))}; keywords of a "
                "hybrid patch go to every entry that has them; give other parameters per entry as "
                "(name, params) pairs"
            )
        entries = [_with_shared_params(entry, params) for entry in entries]
    parts = entries if saved else _merge_equal(entries, layers)
    if len(parts) > 1:
        for cls, _ in parts:
            check_mixable(cls)
    return PatchPlan(parts, layers)


def mixable(cls: type[Encoding]) -> bool:
    """Whether ``cls`` may run in some layers only (:meth:`Encoding.mixable`)."""
    return cls.mixable()


def check_mixable(cls: type[Encoding]) -> None:
    """Refuse an encoding that cannot run in only some layers."""
    reason = cls.mixing_refusal()
    if reason is not None:
        raise InvalidParameterError(f"encoding {cls.name!r} is not allowed in a per-layer pattern: {reason}")


# -- the recipes' checks without a model (``--encoding rope*3+nope``, ``encoding_overrides``) ---------
def check_request(text: str, params: Mapping[str, Any] | None = None) -> None:
    """Validate a recipe's ``--encoding`` (name or pattern text) and its parameters without a model
    (a pattern's length is checked against the model's depth when it is patched)."""
    if not is_pattern_text(text):
        get_encoding(text).config_class.from_params(dict(params or {}))
        return
    names = [name for name, _ in parse_pattern_runs(text)]  # one entry per run: the same checks
    plan_hybrid(names, len(names), params)


def check_overrides(
    saved: Mapping[str, Any], overrides: Mapping[str, Any] | None, *, where: str = ""
) -> None:
    """Validate ``overrides`` of a saved ``config.posenc`` (names and values) without a model: the
    checks :func:`hf_posenc.reconfigure` makes against the learned tensors come after loading."""
    check_saved_entry(saved, where)
    if not overrides:
        return
    if not isinstance(overrides, Mapping):
        raise InvalidParameterError(
            f"encoding_overrides={overrides!r} is not allowed; allowed: a dict of encoding parameters"
        )
    layers = (saved.get("params") or {}).get("layers") if saved.get("encoding") == HYBRID else None
    try:
        plan_saved(saved, overrides, len(layers) if isinstance(layers, list) else 1)
    except InvalidParameterError as error:
        prefix = f"{where}: " if where else ""
        raise InvalidParameterError(f"{prefix}overriding the saved encoding parameters: {error}") from None
