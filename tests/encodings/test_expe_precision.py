"""Where ExPE/ExQPE codes of adjacent positions collide in bf16/fp16, and the warning past it.

References: the values measured in issue 11 (bf16/fp16, l = 8, 96, 256) and a brute-force
search over codes built by tests/references/expe.py and exqpe.py (the paper's formulas; ExQPE by its recurrence).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model, token_ids
from references.expe import expe_values

import hf_posenc
from hf_posenc.encodings.expe import ExPEConfig
from hf_posenc.encodings.expe_precision import first_collision
from hf_posenc.encodings.exqpe import ExQPEConfig

#: measured in issue 11: first n whose code equals n+1's, defaults theta = theta1 = 1/2048, theta2 = 1/16
MEASURED = [
    (torch.bfloat16, 8, 1036, 2047),
    (torch.bfloat16, 96, 16352, 12447),
    (torch.bfloat16, 256, 33152, 32959),
    (torch.float16, 8, 8204, 16383),
]


@pytest.mark.parametrize(("dtype", "l", "expe", "exqpe"), MEASURED)
def test_first_collision_matches_the_measured_positions(dtype, l, expe, exqpe):  # noqa: E741
    assert first_collision(ExPEConfig(l=l), dtype) == expe
    assert first_collision(ExQPEConfig(l=l), dtype) == exqpe


def brute_force(codes, dtype: torch.dtype, limit: int) -> int | None:
    """The first n < limit with cast(code(n)) == cast(code(n+1)), codes(n) -> list of floats."""
    previous = None
    for n in range(limit + 1):
        code = torch.tensor(codes(n), dtype=torch.float64).float().to(dtype)
        if previous is not None and torch.equal(previous, code):
            return n - 1
        previous = code
    return None


def exqpe_codes(l: int, S: float, theta1: float, theta2: float, factor: float):  # noqa: E741, N803
    """ExQPE codes by the paper's recurrence, one position after the other (tests/references/exqpe.py's rule)."""
    state = {"n": -1, "p": None}

    def codes(n: int) -> list[float]:
        assert n == state["n"] + 1
        if n == 0:
            p = [S + i * theta1 for i in range(l)]
            p[0] += theta2
        else:
            p = list(state["p"])
            p[n % l] += theta2
        state.update(n=n, p=p)
        return [S + (v - S) / factor for v in p]

    return codes


@pytest.mark.parametrize(
    ("l", "S", "theta", "factor", "dtype"),
    [
        (8, 0.0, 1 / 2048, 1.0, torch.bfloat16),
        (5, 0.25, 0.01, 3.0, torch.bfloat16),
        (4, 0.0, 1 / 512, 1.5, torch.float16),
    ],
)
def test_expe_collision_equals_a_brute_force_search(l, S, theta, factor, dtype):  # noqa: E741, N803
    config = ExPEConfig(l=l, S=S, theta=theta, scaling={"type": "linear", "factor": factor})
    expected = brute_force(lambda n: expe_values(n, l, S, theta, factor), dtype, 20000)
    assert expected is not None and first_collision(config, dtype) == expected


@pytest.mark.parametrize(
    ("l", "S", "theta2", "factor", "dtype"),
    [
        (8, 0.0, 1 / 16, 1.0, torch.bfloat16),
        (3, 0.5, 1 / 8, 3.0, torch.bfloat16),
        (6, -2.0, 1 / 4, 1.0, torch.float16),
    ],
)
def test_exqpe_collision_equals_a_brute_force_search(l, S, theta2, factor, dtype):  # noqa: E741, N803
    config = ExQPEConfig(l=l, S=S, theta2=theta2, scaling={"type": "linear", "factor": factor})
    expected = brute_force(exqpe_codes(l, S, 1 / 2048, theta2, factor), dtype, 40000)
    assert expected is not None and first_collision(config, dtype) == expected


def test_float32_codes_do_not_collide_within_the_horizon():
    assert first_collision(ExPEConfig(l=8), torch.float32) is None
    assert first_collision(ExQPEConfig(l=96), torch.float32) is None


def forward(model, start: int, length: int = 8) -> list[warnings.WarningMessage]:
    ids = token_ids(1, length)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(ids, position_ids=torch.arange(start, start + length)[None])
    return [w for w in caught if "not distinguishable" in str(w.message)]


@pytest.mark.parametrize(("name", "limit"), [("expe", 1036), ("exqpe", 2047)])
def test_a_bf16_model_warns_once_past_the_limit(name, limit):
    model = make_model("llama").to(torch.bfloat16)
    hf_posenc.patch_model(model, name, l=8)
    assert forward(model, limit - 8) == []  # positions up to limit: still distinct
    caught = forward(model, limit - 4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "\n" not in message
    assert f"positions past {limit} are not distinguishable in torch.bfloat16" in message
    assert forward(model, limit + 100) == []  # once
    fp32 = make_model("llama")
    hf_posenc.patch_model(fp32, name, l=8)
    assert forward(fp32, 40000) == []


def test_reconfigure_recomputes_the_limit():
    model = make_model("llama").to(torch.bfloat16)
    hf_posenc.patch_model(model, "expe", l=8)
    assert len(forward(model, 1040)) == 1
    hf_posenc.reconfigure(model, scaling={"type": "linear", "factor": 3.0})
    limit = first_collision(ExPEConfig(l=8, scaling={"type": "linear", "factor": 3.0}), torch.bfloat16)
    assert limit > 1048
    assert forward(model, 1040) == []
    caught = forward(model, limit - 2)
    assert len(caught) == 1 and f"positions past {limit} " in str(caught[0].message)


@pytest.mark.parametrize(("name", "factor"), [("expe", 1e-7), ("exqpe", 1e-6), ("exqpe", 2e-6)])
def test_a_float16_forward_whose_codes_overflow_is_refused_in_one_line(name, factor):
    """ExPE/ExQPE write their codes into the q/k input in the model's dtype: a code that float16
    rounds to inf made the logits NaN (issue 19's adversarial round: expe at factor 1e-7, exqpe
    at 1e-6, 64 tokens). The paper's codes
    (tests/references) cast to float16 say where: a forward reaching the first position whose
    codes are inf is refused naming it, the forward just before it is not."""
    from references.exqpe import exqpe_values

    from hf_posenc.errors import PositionRangeError

    model = make_model("llama").half()
    hf_posenc.patch_model(model, name, scaling={"type": "linear", "factor": factor})
    l = model.config.hidden_size // 8  # noqa: E741 - the default l
    if name == "expe":
        codes = lambda n: expe_values(n, l, 0.0, 1 / 2048, factor)  # noqa: E731
    else:
        codes = lambda n: exqpe_values(n, l, 0.0, 1 / 2048, 1 / 16, factor)  # noqa: E731
    first = next(n for n in range(64) if not torch.tensor(codes(n)).to(torch.float16).isfinite().all())
    assert first > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the collision warning, which these positions also pass
        with (
            pytest.raises(
                PositionRangeError, match=rf"^{name}: position {first} .*float16.*allowed: "
            ) as caught,
            torch.no_grad(),
        ):
            model(token_ids(1, 64))
        assert "\n" not in str(caught.value)
        with torch.no_grad():
            model(token_ids(1, first))  # positions 0 .. first-1: their codes are finite, not refused
