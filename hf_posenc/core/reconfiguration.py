"""``reconfigure``: change the inference-time parameters of a patched model in place.

A patched model's encoding module keeps every learned tensor (the same ``Parameter`` and
buffer objects, bit-identical values, so an optimizer holding them keeps working); only its
configuration and what is derived from it change: non-persistent buffers (FoPE's clipped
frequencies), plain attributes computed in ``__init__`` (RoPE's dynamic flag, FIRE's L) and
values cached between forwards (Sandwich's kernel, FIRE's linear pieces) are rebuilt from a
fresh module built with the new configuration.

Refused, with the model left exactly as it was:

- a change that alters the set or shape of the learned tensors (``state_dict`` keys/shapes):
  t5 ``num_buckets``, ``learned`` ``max_positions``, FIRE ``mlp_width``, ``shared_across_*``...;
- a change of a parameter that only chooses the learned tensors' initial values (LieRE's
  ``theta``, FIRE's ``init_c``, KERPLE's ``variant``...): a patched model already holds trained
  values, so such a change would be recorded without any effect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..encodings.base import Encoding, clear_module_caches
from ..errors import InvalidParameterError, NotPatchedError
from .config import EncodingConfig
from .interpolation import check_scaled_range

#: instance attributes an ``nn.Module`` manages itself: never copied from the fresh module
_MODULE_INTERNALS = frozenset({"training"})


def _fresh(cls: type[Encoding], config: EncodingConfig, geometry: Any) -> Encoding:
    """A new encoding module on the CPU, with a fixed seed (random inits compare equal)."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        return cls(config, geometry)


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def _changed(old: EncodingConfig, new: EncodingConfig) -> list[str]:
    before, after = old.to_dict(), new.to_dict()
    return [name for name in after if before.get(name) != after[name]]


def new_configuration(encoding: Encoding, current: EncodingConfig, params: dict[str, Any]) -> EncodingConfig:
    """The resolved config of ``encoding`` (now configured as ``current``) with ``params`` changed,
    checked against its learned tensors; raises :class:`InvalidParameterError` when the change cannot
    be made in place."""
    cls = type(encoding)
    config = cls.config_class.from_params({**current.to_dict(), **params}).resolve(encoding.geometry)
    changed = _changed(current, config)
    if not changed:
        return config
    names = ", ".join(f"{name}={config.to_dict()[name]!r}" for name in changed)
    fresh, before = _fresh(cls, config, encoding.geometry), _shapes(encoding)
    after = _shapes(fresh)
    if after != before:
        differences = sorted(
            f"{key} {before.get(key, 'absent')} -> {after.get(key, 'absent')}"
            for key in set(before) | set(after)
            if before.get(key) != after.get(key)
        )
        raise InvalidParameterError(
            f"reconfigure: {cls.name} parameters {names} are not allowed in place: they change the learned "
            f"tensors ({'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}); allowed: "
            "parameters that keep every learned tensor's name and shape (unpatch_model and patch_model again "
            "to start new tensors)"
        )
    initial = _fresh(cls, current, encoding.geometry).state_dict()
    init_only = sorted(
        key for key, value in fresh.state_dict().items() if not torch.equal(value, initial[key])
    )
    if init_only:
        raise InvalidParameterError(
            f"reconfigure: {cls.name} parameters {names} are not allowed in place: they choose the initial "
            f"values of learned tensors ({', '.join(init_only[:4])}{', ...' if len(init_only) > 4 else ''}), "
            "which a patched model already holds; allowed: inference-time parameters (unpatch_model and "
            "patch_model again to re-initialise)"
        )
    # the bound on a scaling factor reads the tensors as trained (e.g. LieRE's generators)
    fresh.load_state_dict(encoding.state_dict())
    check_scaled_range(cls.name, fresh.scaled_range())
    return config


def _derived_state(live: Encoding, fresh: Encoding) -> list[tuple[Any, str, Any, Any]]:
    """(container, key, old, new) for every non-learned value ``fresh`` holds differently from ``live``:
    plain attributes and non-persistent buffers of each submodule (learned tensors are kept)."""
    changes: list[tuple[Any, str, Any, Any]] = []
    fresh_modules = dict(fresh.named_modules())
    for name, module in live.named_modules():
        other = fresh_modules.get(name)
        if other is None:
            continue
        for key, value in other.__dict__.items():
            if key.startswith("_") or key in _MODULE_INTERNALS or key not in module.__dict__:
                continue
            if isinstance(value, (torch.Tensor, nn.Module)):  # tensors live in _parameters/_buffers
                continue
            changes.append((module.__dict__, key, module.__dict__[key], value))
        for key in module._non_persistent_buffers_set:
            old = module._buffers.get(key)
            new = other._buffers.get(key)
            if old is not None and new is not None:
                changes.append((module._buffers, key, old, new.to(device=old.device, dtype=old.dtype)))
    return changes


def _part_params(record: Any, params: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(part index, its parameters) for every part that has one of ``params``. A parameter no part
    has is refused: a single encoding's own refusal lists its parameters; a hybrid's names it."""
    classes = [type(part) for part in record.parts]
    known = {name for cls in classes for name in cls.config_class.parameter_names()}
    unknown = set(params) - known
    if unknown and len(classes) > 1:
        raise InvalidParameterError(
            f"reconfigure: no encoding of the hybrid {'+'.join(cls.name for cls in classes)} has "
            f"parameter(s) {', '.join(map(repr, sorted(unknown)))}; allowed: parameters of its encodings "
            "(each goes to every part that has it)"
        )
    out = []
    for index, cls in enumerate(classes):
        own = {k: v for k, v in params.items() if k in unknown or k in cls.config_class.parameter_names()}
        if own or len(classes) == 1:
            out.append((index, own))
    return out


def reconfigure(model: nn.Module, /, **params: Any) -> nn.Module:
    """Change inference-time parameters of a patched ``model`` in place and return it.

    ``params`` are the encoding's parameters, as for :func:`patch_model` (e.g.
    ``scaling={"type": "linear", "factor": 2.0}``); the others keep their current values. Every
    learned tensor stays the same object with the same values; ``patch_info(model)`` and
    ``model.config.posenc`` show the new values, and ``save_pretrained`` saves them. Parameters
    that would change the learned tensors' names or shapes, or that only choose their initial
    values, raise :class:`InvalidParameterError` and leave the model as it was. A KV cache
    filled before the call holds keys of the old parameters: start a new one. On a per-layer hybrid,
    each parameter goes to every part whose encoding has it (one no part has is refused).
    """
    from .patch import CONFIG_KEY, PATCH_ATTRIBUTE, transformers_model

    target = transformers_model(model)
    record = getattr(target, PATCH_ATTRIBUTE, None)
    if record is None:
        raise NotPatchedError(
            f"{type(model).__name__} is not patched by hf_posenc; reconfigure changes a patched model "
            "(call hf_posenc.patch_model first)"
        )
    parts: list[Encoding] = record.parts
    new = [
        (index, new_configuration(parts[index], record.configs[index], own))
        for index, own in _part_params(record, params)
    ]
    changes = [
        change
        for index, config in new
        for change in _derived_state(parts[index], _fresh(type(parts[index]), config, parts[index].geometry))
    ]
    old_entry, old_configs = getattr(target.config, CONFIG_KEY), list(record.configs)
    old_stages = [runtime.stages for runtime in record.runtime.parts]
    configs = list(record.configs)
    for index, config in new:
        configs[index] = config
    try:
        for container, key, _, value in changes:
            container[key] = value
        record.configs = configs
        setattr(target.config, CONFIG_KEY, record.entry())
        for index, _ in new:
            record.runtime.parts[index].refresh_stages()
    except BaseException:
        for container, key, old, _ in reversed(changes):
            container[key] = old
        record.configs = old_configs
        for runtime, stages in zip(record.runtime.parts, old_stages, strict=True):
            runtime.stages = stages
        setattr(target.config, CONFIG_KEY, old_entry)
        raise
    for index, _ in new:
        clear_module_caches(parts[index])
    record.runtime.reset()
    return model
