"""The package's floors: old import paths keep working for one release, with a warning, and the
top level stays a handful of modules."""

import importlib
import subprocess
import sys
from pathlib import Path

import hf_posenc
from hf_posenc import _moved

PACKAGE = Path(hf_posenc.__file__).parent


def test_an_old_module_path_is_the_new_module_with_a_deprecation_warning():
    """``import hf_posenc.<old>`` returns the very module object at its new path, and warns once
    (every old path, in one fresh interpreter so no earlier import hides a warning)."""
    code = (
        "import importlib, sys, warnings\n"
        f"moved = {dict(_moved.MOVED)!r}\n"
        "for old, new in moved.items():\n"
        "    warnings.simplefilter('error')\n"
        "    module = importlib.import_module(f'hf_posenc.{new}')\n"
        "    warnings.simplefilter('always')\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        alias = importlib.import_module(f'hf_posenc.{old}')\n"
        "    assert alias is module, (old, alias, module)\n"
        "    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        "    assert any(f'hf_posenc.{old} moved to hf_posenc.{new}' in m for m in messages), (old, messages)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_old_submodule_path_resolves_to_the_moved_file_once():
    """``hf_posenc.training.loop`` is ``hf_posenc.recipes.training.loop``: the file is not loaded twice."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import hf_posenc.training.loop as old\n"
        "import hf_posenc.recipes.training.loop as new\n"
        "assert old is new and old.__name__ == 'hf_posenc.recipes.training.loop'\n"
        "from hf_posenc.patch import patch_model\n"
        "assert patch_model is __import__('hf_posenc').patch_model\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_moved_target_exists():
    """Each entry of the old-path table names a module that imports."""
    for new in _moved.MOVED.values():
        assert importlib.util.find_spec(f"hf_posenc.{new}") is not None, new


def test_the_top_level_is_a_handful_of_modules():
    """The package root holds its public face only; the library and recipes live in subpackages."""
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__", "__main__", "_moved", "_version", "compat", "errors"], modules
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["attention", "core", "encodings", "models", "recipes"], packages


def test_the_library_never_imports_the_recipes():
    """Nothing in the library floor (core and the three axes) imports ``recipes``."""
    offenders = []
    for floor in ("core", "encodings", "attention", "models"):
        for file in (PACKAGE / floor).rglob("*.py"):
            text = file.read_text(encoding="utf-8")
            if "recipes" in "".join(
                line for line in text.splitlines() if line.lstrip().startswith(("from ", "import "))
            ):
                offenders.append(str(file.relative_to(PACKAGE)))
    offenders += [
        f"{name}.py"
        for name in ("compat", "errors", "_version")
        if "recipes" in (PACKAGE / f"{name}.py").read_text()
    ]
    assert not offenders, offenders


def test_the_version_module_imports_nothing():
    """``__version__`` lives in a module with no imports, so any module may read it."""
    text = (PACKAGE / "_version.py").read_text(encoding="utf-8")
    assert not [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert hf_posenc.__version__ == importlib.import_module("hf_posenc._version").__version__
