"""Per-layer hybrid encodings: one patch, a different encoding in different layers.

SmolLM3 and Llama 4 ship "NoPE every 4th layer": ``patch_model(model, ["rope", "rope", "rope",
"nope"])``. A request is turned into a :class:`HybridPlan`: the distinct encodings (*parts*, in
order of their first layer) and, for every layer, the part that runs there.

Accepted forms (every entry is a name, an :class:`~hf_posenc.core.config.EncodingConfig`, a
``(name, params)`` pair or the ``{"encoding": ..., "params": ...}`` mapping):

- a list: a pattern repeated over the depth (truncated at the last layer);
- a mapping of layer indices to entries, with ``"default"`` for the layers not named:
  ``{"default": "rope", 3: "nope", 7: "nope"}`` (the explicit layer -> encoding form);
- the text form used by the recipes: entries joined by ``+``, ``NAME*N`` repeating one N times:
  ``"rope*3+nope"`` (a pattern, as a list);
- the serialised form stored in ``config.posenc`` (``{"encoding": "hybrid", "params": {"parts":
  [...], "layers": [...]}}``).

Equal entries (same encoding, same parameters) form one part that owns all their layers and
shares its tensors across them, as a plain patch does. Each part is built for the layers it owns
(its :class:`~hf_posenc.models.base.ModelGeometry` lists only those, in order, and it sees them
as layers ``0..n-1``), so per-layer tensors exist only for its own layers; its tensors are saved
under ``posenc.parts.<i>.``. A plan whose layers all run one part is the plain patch.

Encodings that act on the embeddings (sinusoidal, learned) or pass a stream from layer to layer
(TAPE) are not per-layer: they are refused in a hybrid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from ..encodings.base import Encoding
from ..errors import InvalidParameterError
from ..models.base import ModelGeometry
from .config import HYBRID_FORMAT_VERSION, EncodingConfig

#: ``config.posenc["encoding"]`` of a hybrid patch
HYBRID = "hybrid"
__all__ = ["HYBRID", "HYBRID_FORMAT_VERSION", "HybridEncoding", "HybridPlan", "plan_hybrid"]
#: the key of the explicit form naming the encoding of every layer not listed
DEFAULT_KEY = "default"
PART_KEYS = ("encoding", "params")


@dataclasses.dataclass
class HybridPlan:
    """Distinct encodings (``parts``: class and unresolved config) and the part of every layer."""

    parts: list[tuple[type[Encoding], EncodingConfig]]
    layers: list[int]

    def owned(self, part: int) -> list[int]:
        """The layers ``part`` runs in, in order."""
        return [layer for layer, owner in enumerate(self.layers) if owner == part]


def is_pattern_text(value: Any) -> bool:
    """Whether ``value`` is the text form of a pattern (``"rope*3+nope"``)."""
    return isinstance(value, str) and ("+" in value or "*" in value)


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
        return bool(encoding) and all(
            key == DEFAULT_KEY or (isinstance(key, int) and not isinstance(key, bool)) for key in encoding
        )
    return False


def parse_pattern_text(text: str) -> list[str]:
    """``"rope*3+nope"`` -> ``["rope", "rope", "rope", "nope"]``."""
    entries: list[str] = []
    for item in str(text).split("+"):
        name, star, count = item.strip().partition("*")
        name = name.strip()
        repeat = 1
        if star:
            try:
                repeat = int(count.strip())
            except ValueError:
                repeat = 0
        if not name or repeat < 1:
            raise InvalidParameterError(
                f"encoding pattern {text!r}: entry {item.strip()!r} is not allowed; allowed: NAME or NAME*N "
                "(N >= 1) joined by '+', e.g. 'rope*3+nope'"
            )
        entries.extend([name] * repeat)
    return entries


def pattern_text(names: Sequence[str]) -> str:
    """Per-layer names -> the shortest run-length text (``rope*3+nope+rope*3+nope``)."""
    runs: list[list[Any]] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return "+".join(name if count == 1 else f"{name}*{count}" for name, count in runs)


def entry_config(entry: Any) -> tuple[type[Encoding], EncodingConfig]:
    """One entry (name, config object, ``(name, params)`` or mapping) -> (class, config)."""
    from .registry import get_encoding

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
    if is_pattern_text(encoding):
        encoding = parse_pattern_text(encoding)
    if _is_pair(encoding):
        return [encoding] * num_layers
    if isinstance(encoding, (list, tuple)):
        if not encoding:
            raise InvalidParameterError("an encoding pattern needs at least one entry; got an empty list")
        return [encoding[layer % len(encoding)] for layer in range(num_layers)]
    if isinstance(encoding, Mapping) and encoding.get("encoding") == HYBRID:
        return _serialised_entries(encoding, num_layers)
    assert isinstance(encoding, Mapping)
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


def _serialised_entries(encoding: Mapping[str, Any], num_layers: int) -> list[Any]:
    params = encoding.get("params")
    parts = params.get("parts") if isinstance(params, Mapping) else None
    layers = params.get("layers") if isinstance(params, Mapping) else None
    if not isinstance(parts, list) or not isinstance(layers, list):
        raise InvalidParameterError(
            "a hybrid config.posenc needs params {'parts': [{'encoding': ..., 'params': ...}, ...], "
            f"'layers': [part index per layer]}}; got {params!r}"
        )
    if len(layers) != num_layers or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(parts) for i in layers
    ):
        raise InvalidParameterError(
            f"a hybrid config.posenc's 'layers' must give one part index (0 .. {len(parts) - 1}) per layer "
            f"of the model ({num_layers}); got {layers!r}"
        )
    return [parts[i] for i in layers]


def _with_shared_params(
    entry: tuple[type[Encoding], EncodingConfig], params: Mapping[str, Any]
) -> tuple[type[Encoding], EncodingConfig]:
    cls, config = entry
    own = {k: v for k, v in params.items() if k in cls.config_class.parameter_names()}
    if not own:
        return entry
    return cls, cls.config_class.from_params({**config.to_dict(), **own})


def plan_hybrid(encoding: Any, num_layers: int, params: Mapping[str, Any] | None = None) -> HybridPlan:
    """The plan of a hybrid request for a model with ``num_layers`` layers.

    ``params`` (keywords of ``patch_model``) go to every entry whose encoding has that parameter;
    one that no entry has is refused. Embed-stage and cross-layer encodings are refused when the
    plan mixes encodings."""
    entries = [entry_config(entry) for entry in _per_layer_entries(encoding, num_layers)]
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
    parts: list[tuple[type[Encoding], EncodingConfig]] = []
    layers: list[int] = []
    for cls, config in entries:
        index = next(
            (i for i, (c, k) in enumerate(parts) if c is cls and k.to_dict() == config.to_dict()), None
        )
        if index is None:
            index = len(parts)
            parts.append((cls, config))
        layers.append(index)
    if len(parts) > 1:
        for cls, _ in parts:
            check_mixable(cls)
    return HybridPlan(parts, layers)


def mixable(cls: type[Encoding]) -> bool:
    """Whether ``cls`` may run in some layers only (no embed stage, no stream across layers)."""
    return "embed" not in cls.stages() and not cls.carries_layer_stream


def check_mixable(cls: type[Encoding]) -> None:
    """Refuse an encoding that cannot run in only some layers."""
    if "embed" in cls.stages():
        raise InvalidParameterError(
            f"encoding {cls.name!r} is not allowed in a per-layer pattern: it adds positions to the token "
            "embeddings, before any layer, so it cannot be given to some layers only; allowed: encodings "
            "that act inside attention (e.g. rope, nope, alibi, t5, fox)"
        )
    if cls.carries_layer_stream:
        raise InvalidParameterError(
            f"encoding {cls.name!r} is not allowed in a per-layer pattern: it passes a positional stream "
            "from each layer to the next, so it cannot skip layers; allowed: encodings whose layers are "
            "independent (e.g. rope, nope, alibi, t5, fox)"
        )


def part_geometry(geometry: ModelGeometry, layers: Sequence[int]) -> ModelGeometry:
    """The geometry a part sees: only the layers it owns, renumbered ``0..len(layers)-1``."""
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


# -- the text form in the recipes (``--encoding rope*3+nope``, lm-eval ``encoding=rope*3+nope``) --------
def canonical_request(text: str) -> str:
    """An encoding name or pattern text with aliases resolved: ``"RoPE*3+NoPE"`` -> ``"rope*3+nope"``."""
    from .registry import canonical_name

    if not is_pattern_text(text):
        return canonical_name(text)
    return pattern_text([canonical_name(name) for name in parse_pattern_text(text)])


def check_request(text: str, params: Mapping[str, Any] | None = None) -> None:
    """Validate a recipe's ``--encoding`` (name or pattern text) and its parameters without a model."""
    from .registry import get_encoding

    if not is_pattern_text(text):
        get_encoding(text).config_class.from_params(dict(params or {}))
        return
    names = parse_pattern_text(text)
    plan_hybrid(names, len(names), params)


def saved_description(saved: Mapping[str, Any]) -> str:
    """A saved ``config.posenc``'s encoding as a recipe names it: the name, or the per-layer text."""
    if saved.get("encoding") != HYBRID:
        return str(saved.get("encoding"))
    params = saved.get("params") or {}
    parts = [part.get("encoding") for part in params.get("parts") or []]
    return pattern_text([str(parts[i]) for i in params.get("layers") or []])


def matches_saved(text: str, saved: Mapping[str, Any]) -> bool:
    """Whether a recipe's ``--encoding`` names the encoding a checkpoint was saved with (a pattern
    matches a hybrid whose layers repeat it)."""
    requested = canonical_request(text)
    if saved.get("encoding") != HYBRID:
        return requested == saved.get("encoding")
    layers = parse_pattern_text(saved_description(saved))
    names = parse_pattern_text(requested)
    return [names[i % len(names)] for i in range(len(layers))] == layers
