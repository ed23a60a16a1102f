"""Settings files for the recipes: ``--config run.yaml`` (or ``.json``) of ``study`` and ``train``.

A file holds a mapping of a settings dataclass's fields, either at the top level or under a
section named after the command (``study:`` / ``train:``), so one file can hold both. Unknown
keys are an error naming them and the allowed ones. Imports nothing heavy (``yaml`` only for
``.yaml``/``.yml`` files).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError


def list_fields(settings: Any) -> set[str]:
    """The fields of the settings dataclass ``settings`` that hold lists (``list[...]``, or None)."""
    import dataclasses

    return {f.name for f in dataclasses.fields(settings) if str(f.type).startswith("list[")}


def load_settings_file(
    path: str, *, allowed: Iterable[str], section: str, lists: Iterable[str] = ()
) -> dict[str, Any]:
    """The settings in ``path`` (YAML or JSON), checked against the ``allowed`` field names. A
    field of ``lists`` given one value (``data: corpus.txt``) is that value's one-item list (it
    was iterated: each character a data source)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config {path!r} does not exist; allowed: a YAML or JSON file")
    text = file.read_text(encoding="utf-8")
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.load(text, Loader=_yaml_loader())
        else:
            values = json.loads(text)
    except Exception as error:  # yaml.YAMLError, json.JSONDecodeError
        detail = " ".join(str(error).split())
        raise InvalidParameterError(f"--config {path!r} is not valid YAML/JSON: {detail}") from None
    values = values.get(section, values) if isinstance(values, dict) else values
    if not isinstance(values, dict):
        raise InvalidParameterError(f"--config {path!r} must hold a mapping of {section} settings")
    names = list(allowed)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise InvalidParameterError(
            f"--config {path!r}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(names)}"
        )
    listed = set(lists)
    return {
        key: [value] if key in listed and isinstance(value, (str, int, float)) else value
        for key, value in values.items()
    }


def _yaml_loader() -> Any:
    """PyYAML's safe loader reading ``1e-3`` as the number it is: PyYAML follows YAML 1.1, whose
    floats need a dot (``1.0e-3``), so ``lr: 1e-3`` was the string '1e-3' and refused as "not a
    number" (YAML 1.2, and JSON, read it as a float). A subclass: PyYAML's own loader is left as is."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return Loader
