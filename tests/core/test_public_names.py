"""The package's public face is one list: every lazily exported name (``_EXPORTS``) is in
``__all__``, visible to static checkers (the ``TYPE_CHECKING`` imports) and importable, and every
registered encoding's config class is among them."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_posenc
from hf_posenc.core.registry import encoding_classes


def _type_checking_names() -> set[str]:
    tree = ast.parse(Path(hf_posenc.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    names |= {alias.name for alias in statement.names}
    return names


def test_every_export_is_listed_typed_and_importable():
    exports = set(hf_posenc._EXPORTS)
    assert exports - set(hf_posenc.__all__) == set()
    assert exports - _type_checking_names() == set()
    for name in hf_posenc.__all__:
        assert getattr(hf_posenc, name) is not None, name


def test_every_encodings_config_class_is_exported():
    configs = {cls.config_class.__name__ for cls in encoding_classes()}
    assert configs - set(hf_posenc.__all__) == set()
