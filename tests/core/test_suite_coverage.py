"""The suite covers every axis hf_posenc registers: each encoding has cases in the one
registry (tests/encoding_cases.py) that drives the shared invariants, each model family is a
value of the ``family`` fixture, and each attention backend is exercised by the module that
compares it with the eager reference. The facts written down in the registry (which encodings
have no parameters, which need explicit scores) are checked against the package here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
from encoding_cases import (
    ALL_CASES,
    CASES_BY_ENCODING,
    PARAMETER_FREE,
    REFERENCE_CASES,
    case_id,
    case_ids,
    has_explicit_scores,
    serves,
)
from references import REFERENCES

import hf_posenc
from hf_posenc.attention.backend import backend_choices
from hf_posenc.core.registry import canonical_name

TESTS = Path(__file__).parents[1]

#: the test module that compares each attention backend with the eager reference core
BACKEND_TESTS = {
    "sdpa": "core/test_invariants.py",  # test_eager_backend_equals_sdpa_backend, every family and case
    "eager": "core/test_invariants.py",  # the reference side of that comparison
    "chunked": "attention/test_backends.py",
    "flex": "attention/test_backends.py",
    "auto": "attention/test_backends.py",
}


def module_constant(module: str, name: str):
    """The literal value a test module assigns to ``name``, read from its source (tests never import
    test modules)."""
    for node in ast.parse((TESTS / module).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{module} assigns no {name}")


def registered_backends() -> set[str]:
    """The backend names ``patch_model(backend=...)`` accepts (the registry's selectable backends
    plus ``auto``); kernels that only serve calls ``auto`` hands them (flash-attn, fla, rows) are
    covered by tests/attention/test_backends.py's own backend x encoding matrix."""
    return set(backend_choices())


def test_every_registered_encoding_has_cases_and_no_case_is_unregistered():
    """Every registered encoding has cases, a formula reference (tests/references/) and reference
    cases (those test_formula_references.py runs), and nothing else is there."""
    registered = {info.name for info in hf_posenc.list_encodings()}
    assert set(CASES_BY_ENCODING) == registered
    for key, cases in CASES_BY_ENCODING.items():
        assert cases, key
        assert {canonical_name(name) for name, _ in cases} == {key}
    assert set(REFERENCES) == registered
    assert {name for name, _ in REFERENCE_CASES} == registered


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_the_invariants_run_on_every_registered_case_and_family():
    """pytest collects every invariant that takes a case for every family x registered case
    (test_eager_backend_equals_sdpa_backend: the cases that are not has_explicit_scores)."""
    assert len(set(case_ids(ALL_CASES))) == len(ALL_CASES), "case ids must be unique"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", "slow or not slow", str(TESTS / "core" / "test_invariants.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=TESTS.parent,
    ).stdout
    ids: dict[str, set[str]] = {}
    for line in collected.splitlines():
        if "::" in line and "[" in line:
            test, params = line.split("::")[1].split("[", 1)
            ids.setdefault(test, set()).add(params[:-1])
    sdpa_cases = [case for case in ALL_CASES if not has_explicit_scores(case)]
    families = tuple(f"{family}-" for family in conftest.FAMILIES)
    invariants = [name for name, found in ids.items() if all(i.startswith(families) for i in found)]
    assert len(invariants) >= 9, sorted(ids)
    for test in invariants:
        cases = sdpa_cases if test == "test_eager_backend_equals_sdpa_backend" else ALL_CASES
        # every case on the families of the encoding-specific files; each encoding's first case on the others
        first = [next(c for c in cases if c[0] == name) for name in dict.fromkeys(n for n, _ in cases)]
        expected = {
            f"{family}-{case_id(case)}"
            for family in conftest.FAMILIES
            for case in (cases if family in conftest.ENCODING_FILE_FAMILIES else first)
            if serves(family in conftest.ROTARY_FAMILIES, case)
        }
        assert ids[test] == expected, test


def test_every_supported_family_is_a_family_fixture_value():
    """Every registered family is a value of the tests' ``family``, and every model_type that
    ``supported_families()`` lists is served by one of them."""
    from hf_posenc.core.registry import families

    assert set(conftest.FAMILIES) == set(families())
    served = {model_type for adapter in families().values() for model_type in adapter.model_types}
    assert served == set(hf_posenc.supported_families())


def test_every_backend_is_compared_with_eager_by_a_named_module():
    assert set(BACKEND_TESTS) == registered_backends()
    for backend, module in BACKEND_TESTS.items():
        source = (TESTS / module).read_text()
        assert f'"{backend}"' in source, f"{module} never names backend {backend!r}"
    assert set(module_constant("core/test_invariants.py", "FULL_BACKENDS")) == {
        b for b, m in BACKEND_TESTS.items() if m == "core/test_invariants.py"
    }


@pytest.mark.parametrize("name", sorted(CASES_BY_ENCODING))
def test_parameter_free_encodings_are_the_ones_without_parameters(name):
    """PARAMETER_FREE (which test_optimizer_step_trains_the_encoding relies on) is what the
    encodings are, and each parameter-free encoding has a formula reference to check against."""
    model = conftest.patch(conftest.make_model("llama"), name, randomize=False)
    assert (not list(model.posenc.parameters())) == (name in PARAMETER_FREE)
    if name in PARAMETER_FREE:
        assert callable(REFERENCES[name].layer_reference)


@pytest.mark.parametrize("case", ALL_CASES, ids=case_ids(ALL_CASES))
def test_explicit_score_cases_are_the_ones_with_an_explicit_score_stage(case):
    """has_explicit_scores (the cases test_eager_backend_equals_sdpa_backend leaves out) names
    exactly the cases whose encoding runs a ``logits``, ``transform_scores`` or ``normalize`` stage."""
    name, params = case
    model = conftest.patch(conftest.make_model("llama"), name, params, randomize=False)
    stages = set(model.posenc.active_stages())
    assert bool(stages & {"logits", "transform_scores", "normalize"}) == has_explicit_scores(case)
