"""The one registry of per-encoding test cases.

A case is ``(encoding name, patch parameters)``. Every registered encoding has at least its
defaults here plus the variants whose code paths differ; ``test_invariants.py`` runs the shared
invariants (KV-cache decoding, left padding, save/reload, unpatch, training, checkpointing,
bf16, backends) on all of them, each encoding's own module draws its cases from here with
:func:`cases_of`, and ``test_suite_coverage.py`` checks that nothing registered in hf_posenc is
missing. Nothing here imports hf_posenc: the facts below are written down, not read back
from the code under test, and the coverage test compares the two.
"""

from __future__ import annotations

from typing import Any

Case = tuple[str, dict[str, Any]]

#: name -> cases; the first case of each encoding is its defaults
CASES_BY_ENCODING: dict[str, list[Case]] = {
    # -- classical ------------------------------------------------------------------------
    "nope": [("nope", {})],
    "sinusoidal": [("sinusoidal", {})],
    "learned": [("learned", {})],
    "t5": [
        ("t5", {}),
        ("t5", {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}),
    ],
    "alibi": [("alibi", {})],
    "rope": [
        ("rope", {}),
        ("rope", {"scaling": {"type": "linear", "factor": 4.0}}),
        ("rope", {"scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}}),
        ("rope", {"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
        ("rope", {"partial_rotary_factor": 0.5, "theta": 500.0}),
    ],
    # xpos: defaults, linear scaling (rotation and decay at n/f) with partial rotary and a short
    # scale base (strong decay), and a frequency-only schedule (yarn: the decay keeps n)
    "xpos": [
        ("xpos", {}),
        (
            "xpos",
            {"scaling": {"type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5, "scale_base": 8.0},
        ),
        ("xpos", {"scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    ],
    # -- training-free extension of the checkpoint's RoPE (RoPE families only): the first case has
    # a window short enough that the tests' inputs (12..48 tokens) reach the far keys; then the
    # defaults (window: a quarter of the trained length) and a scaled RoPE under the split ----------
    "selfextend": [
        ("selfextend", {"group_size": 2, "window": 4}),
        ("selfextend", {}),
        ("selfextend", {"group_size": 3, "window": 5, "scaling": {"type": "linear", "factor": 2.0}}),
    ],
    "rerope": [("rerope", {"window": 3}), ("rerope", {})],
    "leaky_rerope": [("leaky_rerope", {"window": 3, "leak": 4.0}), ("leaky_rerope", {})],
    "expe": [
        ("expe", {}),
        ("expe", {"override_value": True, "S": 0.5, "scaling": {"type": "linear", "factor": 2.0}}),
    ],
    "exqpe": [("exqpe", {}), ("exqpe", {"l": 5, "theta2": 0.25})],
    # -- relative score biases: both KERPLE kernels, shared and per-layer tables, a short FIRE
    # threshold L (queries past L are interpolated by their position), shared FIRE ------------
    "kerple": [("kerple", {}), ("kerple", {"variant": "power", "shared_across_layers": False})],
    "sandwich": [("sandwich", {})],
    "fire": [("fire", {}), ("fire", {"init_L": 20.0, "shared_across_layers": True, "mlp_width": 8})],
    # -- contextual: scores read or rewritten by the encoding ------------------------------------
    "cope": [
        ("cope", {}),
        ("cope", {"npos_max": 4, "shared_across_layers": True}),  # positions clamp at 3
    ],
    "sba": [("sba", {}), ("sba", {"attend_current": True, "remainder": "drop"})],
    # CAPE at its default width 32 with the tests' N(0, 0.5) random weights amplifies the fp32
    # rounding of q.k (blocked differently in a decoding step and a full forward) to ~1e-5 on
    # the logits, the invariants' tolerance; a narrower MLP keeps the same code path. The
    # default width is checked against the formula reference (REFERENCE_CASES below).
    "cape": [
        ("cape", {"hidden": 8}),
        ("cape", {"base": "kerple", "base_params": {"variant": "power"}, "hidden": 8}),
        ("cape", {"base": "fire", "hidden": 8}),
    ],
    # -- forget gates ----------------------------------------------------------------------------
    "fox": [("fox", {})],
    "fox_pro": [
        ("fox_pro", {}),
        ("fox_pro", {"qk_norm": False, "output_norm": False, "v_shift": False}),  # k shift + output gate
    ],
    # -- learned rotations: per layer/head generators and coefficients, shared ones, partial
    # rotary (pass-through dims), small LieRE blocks, FoPE's denser grid and heavy clipping -----
    "liere": [
        ("liere", {}),
        (
            "liere",
            {
                "shared_across_layers": True,
                "shared_across_heads": True,
                "block_size": 4,
                "partial_rotary_factor": 0.5,
            },
        ),
    ],
    "fope": [
        ("fope", {}),
        (
            "fope",
            {
                "frequencies_per_dim": 2,
                "shared_across_layers": True,
                "shared_across_heads": True,
                "partial_rotary_factor": 0.5,
                "train_length": 16,
            },
        ),
    ],
    # -- rotations of N-D coordinates: 1-D/N-D, full and partial rotation, both ComRoPE
    # variants, block sizes 2 and 4 ---------------------------------------------------------------
    "rope2d": [("rope2d", {}), ("rope2d", {"axes": 4, "theta": 500.0, "partial_rotary_factor": 0.5})],
    "comrope": [
        ("comrope", {}),
        ("comrope", {"variant": "ld"}),
        ("comrope", {"block_size": 2, "axes": 2}),
        ("comrope", {"variant": "ld", "axes": 2, "partial_rotary_factor": 0.5}),
    ],
    # -- a positional stream per token: the default PE-layer width and a narrow one ----------------
    "tape": [("tape", {}), ("tape", {"position_size": 3, "theta": 500.0})],
}

#: every case of every encoding
ALL_CASES: list[Case] = [case for cases in CASES_BY_ENCODING.values() for case in cases]

#: encodings without trainable parameters of their own (an optimizer step can only move the
#: model's weights); checked against each patched encoding by test_invariants.py
PARAMETER_FREE = frozenset(
    {
        "nope",
        "sinusoidal",
        "alibi",
        "rope",
        "xpos",
        "selfextend",
        "rerope",
        "leaky_rerope",
        "expe",
        "exqpe",
        "sandwich",
        "sba",
        "rope2d",
    }
)

#: the cases each encoding's formula reference (tests/references/) is checked on by
#: tests/encodings/test_formula_references.py: every registered case, plus variants whose formula
#: differs; TAPE runs one narrow PE layer (its reference loops over the stream of every layer)
REFERENCE_CASES: list[Case] = [
    *(case for name, cases in CASES_BY_ENCODING.items() if name != "tape" for case in cases),
    ("sandwich", {"dim": 16}),
    ("kerple", {"variant": "power"}),
    ("cape", {}),  # CAPE at its default MLP width (the cases above narrow it for the invariants)
    ("fope", {"clip": False, "frequencies_per_dim": 3}),
    ("tape", {"position_size": 3}),
]

#: encodings with a score bias, with parameters that exercise their variants: the block backends
#: (chunked, flex, auto) are compared with eager on them (tests/attention/test_backends.py), and
#: every view of their bias with its full matrix (tests/attention/test_block_bias.py)
BLOCK_CASES: list[Case] = [
    ("alibi", {}),
    ("t5", {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}),
    ("kerple", {}),
    ("kerple", {"variant": "power"}),
    ("sandwich", {"dim": 16}),
    ("fire", {"init_L": 6.0}),  # L below the inputs' lengths: the non-Toeplitz rows are exercised
    ("fox", {}),
    ("fox_pro", {}),
]

#: encodings with explicit scores (transform_scores / normalize), each row-local: ``auto`` runs
#: them one block of queries at a time, compared with eager in tests/attention/test_backends.py
ROW_CASES: list[Case] = [
    ("cope", {}),
    ("cape", {}),
    ("cape", {"base": "kerple"}),
    ("cape", {"base": "fire", "base_params": {"init_L": 6.0}}),
    ("sba", {}),
    ("sba", {"attend_current": True, "remainder": "drop"}),
]

#: encodings whose attention needs explicit scores (stage ``logits``, ``transform_scores`` or
#: ``normalize``): ``sdpa`` and ``eager`` run the same explicit-score core for them (the window-split
#: ones have a block backend of their own under ``auto``, compared with eager in their test module)
EXPLICIT_SCORE_ENCODINGS = frozenset({"cope", "sba", "cape", "selfextend", "rerope", "leaky_rerope"})

#: encodings that extend the checkpoint's own RoPE: refused on families whose native encoding is
#: not RoPE, so the shared tests run them on the rotary families only (see :func:`serves`)
ROPE_CHECKPOINT_ONLY = frozenset({"selfextend", "rerope", "leaky_rerope"})


def serves(rotary_family: bool, case: Case) -> bool:
    """Whether a family (natively rotary or not) takes the case's encoding."""
    return rotary_family or case[0] not in ROPE_CHECKPOINT_ONLY


def has_explicit_scores(case: Case) -> bool:
    """True when the case's attention computes explicit scores whatever the backend: the
    contextual encodings, and RoPE with causal dynamic NTK (per-query frequencies: stage ``logits``)."""
    name, params = case
    scaling = params.get("scaling") or {}
    return name in EXPLICIT_SCORE_ENCODINGS or (name == "rope" and scaling.get("type") == "dynamic")


def cases_of(*names: str) -> list[Case]:
    """The registered cases of the named encodings, in registry order."""
    unknown = set(names) - set(CASES_BY_ENCODING)
    if unknown:
        raise KeyError(f"no test cases registered for {sorted(unknown)}")
    return [case for name in names for case in CASES_BY_ENCODING[name]]


def case_id(case: Case) -> str:
    """A readable test id: ``name`` or ``name[key=value,...]`` (a nested dict shows its ``type``
    or its own items)."""
    name, params = case
    if not params:
        return name

    def show(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("type") or "-".join(f"{k}={v}" for k, v in value.items()))
        return str(value)

    return name + "[" + ",".join(f"{key}={show(value)}" for key, value in params.items()) + "]"


def case_ids(cases: list[Case]) -> list[str]:
    return [case_id(case) for case in cases]


#: encoding -> whether head-parallel attention can serve it, from the published attention forms:
#: per-token q/k transforms (rotations, embeddings, layer inputs) and an additive per-head bias
#: split by heads; an explicit score matrix (two position maps, counted positions, an MLP over the
#: heads' scores, stick-breaking) is not split here, nor a stage mixing neighbouring tokens before
#: the exchange (FoX Pro's token shift and QK-norm stage, conservatively) or a positional stream (TAPE)
HEAD_PARALLEL_SERVED: dict[str, bool] = {
    "nope": True,
    "sinusoidal": True,
    "learned": True,
    "rope": True,  # except length-dependent scalings (explicit logits), see head_parallel_serves
    "xpos": True,
    "liere": True,
    "fope": True,
    "rope2d": True,
    "comrope": True,
    "expe": True,
    "exqpe": True,
    "t5": True,
    "alibi": True,
    "kerple": True,
    "sandwich": True,
    "fire": True,
    "fox": True,
    "fox_pro": False,  # unless none of qk_norm, k_shift, v_shift, see head_parallel_serves
    "selfextend": True,  # two RoPE maps, the same for every head (LongLM eq. 3)
    "rerope": True,  # clipped relative positions, the same for every head
    "leaky_rerope": True,
    "cope": True,  # gates from each head's own scores; position table shared (CoPE eq. 3-5)
    "cape": False,  # its MLP reads every head's score of a pair (CAPE eq. 4)
    "sba": True,  # sticks broken per head from its own scores (Tan et al. eq. 2)
    "tape": False,
}


def head_parallel_serves(name: str, params: dict) -> bool:
    if name == "rope" and (params.get("scaling") or {}).get("type") in ("dynamic", "longrope"):
        return False  # frequencies chosen per query length: explicit logits
    if name == "fox_pro":
        return not any(params.get(key, True) for key in ("qk_norm", "k_shift", "v_shift"))
    return HEAD_PARALLEL_SERVED[name]
