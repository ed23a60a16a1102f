"""KERPLE, Sandwich and FIRE: hypothesis properties of their biases, initial values, parameter
validation. Their formula references (tests/references/kerple.py, sandwich.py, fire.py) are
checked against every patched layer by tests/encodings/test_formula_references.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from capture import LENGTH
from conftest import make_model, patch, randomize_encoding, token_ids
from encoding_cases import cases_of
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings.base import probe_call
from hf_posenc.encodings.call import ScoreCall

CASES = cases_of("kerple", "sandwich", "fire")
SETTINGS = settings(max_examples=30, deadline=None)
LOW = float(torch.tensor(0.01))  # KERPLE's lower bound 0.01 as the fp32 value the parameters hold


# -- the reference cases ------------------------------------------------------------------------


def test_fire_reference_case_interpolates_past_the_threshold():
    """The short-L FIRE case really has queries past L (so the reference test covers max(L, i) = i)."""
    model = patch(make_model("llama"), "fire", CASES[-1][1])
    assert float(model.posenc.functions[0].threshold().detach()) < LENGTH - 2


# -- hypothesis properties -------------------------------------------------------------------------


@functools.cache
def patched_model(name: str, params: tuple = ()) -> torch.nn.Module:
    model = make_model("llama")
    hf_posenc.patch_model(model, name, **dict(params))
    randomize_encoding(model)
    return model


RELATIVE = [("alibi", ()), ("sandwich", ()), ("sandwich", (("dim", 6),)), ("kerple", ())]
RELATIVE += [("kerple", (("variant", "power"), ("shared_across_layers", False)))]


@SETTINGS
@given(case=st.sampled_from(RELATIVE), k_len=st.integers(2, 60), layer=st.integers(0, 1), data=st.data())
def test_relative_biases_depend_only_on_i_minus_j(case, k_len, layer, data):
    """kerple, sandwich, alibi: bias[h, i, j] == bias[h, i+1, j+1], and a shorter query block
    (decoding) is the bottom rows of the full square bias."""
    q_len = data.draw(st.integers(1, k_len), label="q_len")
    model = patched_model(*case)
    geometry = model.posenc.geometry
    with torch.no_grad():
        full = model.posenc.score_bias(probe_call(geometry, k_len, k_len, layer_idx=layer)).full()[0]
        last = model.posenc.score_bias(probe_call(geometry, q_len, k_len, layer_idx=layer)).full()[0]
    assert full.shape == (4, k_len, k_len) and last.shape == (4, q_len, k_len)
    assert torch.equal(full[:, 1:, 1:], full[:, :-1, :-1])
    assert torch.equal(last, full[:, k_len - q_len :, :])
    assert full.abs().sum() > 0 and torch.isfinite(full).all()


def fire_context(model, q_len: int, k_len: int, first_position: int, layer_idx: int = 0) -> ScoreCall:
    """A probe whose queries sit at absolute positions first_position .. first_position + q_len - 1."""
    ctx = probe_call(model.posenc.geometry, q_len, k_len, layer_idx=layer_idx)
    positions = torch.arange(first_position, first_position + q_len)[None]
    return dataclasses.replace(ctx, positions=positions, memo=ForwardMemo())


@SETTINGS
@given(
    k_len=st.integers(2, 30),
    offset=st.integers(0, 40),
    layer=st.integers(0, 1),
    short_l=st.booleans(),
    data=st.data(),
)
def test_fire_bias_is_a_function_of_distance_and_query_position(k_len, offset, layer, short_l, data):
    """FIRE's bias at (query i, key j) depends only on (i - j, i): a block of queries at absolute
    positions offset + ... (a KV-cache window, or a row shifted by left padding) equals the
    square bias of a sequence starting at 0, read at (i, i - (i-j))."""
    q_len = data.draw(st.integers(1, k_len), label="q_len")
    model = patched_model("fire", (("init_L", 6.0),) if short_l else ())
    first = offset + k_len - q_len  # absolute position of the first query
    total = offset + k_len
    with torch.no_grad():
        square = model.posenc.score_bias(fire_context(model, total, total, 0, layer)).full()[0]  # (H, T, T)
        block = model.posenc.score_bias(fire_context(model, q_len, k_len, first, layer)).full()[
            0
        ]  # (H, Tq, Tk)
    rows = torch.arange(q_len)[:, None]
    cols = torch.arange(k_len)[None, :]
    distance = (k_len - q_len + rows) - cols  # (Tq, Tk) i - j
    position = first + rows  # (Tq, 1) i
    causal = (distance >= 0).expand(q_len, k_len)
    expected = square[:, position.expand(q_len, k_len), (position - distance).clamp(min=0)]  # (H, Tq, Tk)
    torch.testing.assert_close(block[:, causal], expected[:, causal], atol=1e-6, rtol=1e-6)


def test_fire_bias_is_toeplitz_below_the_threshold_and_not_past_it():
    """While every query position is <= L, FIRE depends on i - j only; past L it does not."""
    long_l = patched_model("fire")  # L = |L_multiplier| * 512, far above 40 positions
    assert float(long_l.posenc.functions[0].threshold().detach()) > 40
    short_l = patched_model("fire", (("init_L", 6.0),))
    with torch.no_grad():
        below = long_l.posenc.score_bias(fire_context(long_l, 40, 40, 0)).full()[0]
        past = short_l.posenc.score_bias(fire_context(short_l, 40, 40, 0)).full()[0]
    causal = torch.ones(39, 39, dtype=torch.bool).tril()
    torch.testing.assert_close(below[:, 1:, 1:][:, causal], below[:, :-1, :-1][:, causal], atol=1e-6, rtol=0)
    assert not torch.allclose(past[:, 1:, 1:][:, causal], past[:, :-1, :-1][:, causal], atol=1e-3)


@SETTINGS
@given(
    params=st.sampled_from(
        [
            {},
            {"variant": "power"},
            {"shared_across_layers": False},
            {"variant": "power", "shared_across_layers": False},
        ]
    ),
    lr=st.floats(10.0, 1e4),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    direction=st.sampled_from([-1.0, 1.0]),
)
def test_kerple_coefficients_stay_in_range_after_a_large_optimizer_step(params, lr, optimizer, direction):
    """After an optimizer step with a huge learning rate that drives r1, r2 far out of range, the
    coefficients the bias uses are still >= 0.01 (power: r2 <= 2), the next training forward
    projects the stored parameters back into range, and the bias stays finite and <= 0."""
    model = patch(make_model("llama"), "kerple", params, randomize=False).train()
    posenc = model.posenc
    make = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    step = make(posenc.parameters(), lr=lr)
    ctx = probe_call(posenc.geometry, 16)
    loss = direction * posenc.score_bias(ctx).full().sum()  # direction -1 pushes r1 and r2 down
    loss.backward()
    step.step()
    if direction < 0:
        assert float(posenc.r1.detach().min()) < LOW and float(posenc.r2.detach().min()) < LOW  # out of range
    for layer in range(posenc.geometry.num_layers):
        r1, r2 = posenc.coefficients(layer)
        assert bool((r1 >= LOW).all() and (r2 >= LOW).all())
        if params.get("variant") == "power":
            assert bool((r2 <= 2.0).all())
    for layer in range(posenc.geometry.num_layers):
        ctx = probe_call(posenc.geometry, 16, layer_idx=layer)
        bias = posenc.score_bias(ctx).full()  # a training forward: projects in place
        assert torch.isfinite(bias).all() and bool((bias <= 0).all())
        bias.sum().backward()  # the projected parameters still receive gradients
    assert float(posenc.r1.detach().min()) >= LOW and float(posenc.r2.detach().min()) >= LOW
    if params.get("variant") == "power":
        assert float(posenc.r2.detach().max()) <= 2.0
    assert torch.isfinite(posenc.r1.grad).all() and torch.isfinite(posenc.r2.grad).all()


# -- initial values, closed forms ---------------------------------------------------------------------


def test_kerple_initial_coefficients_spread_the_reference_ranges():
    """log: r1 in (0, 2), r2 in (0, 1); power: r1 in (0, 1), r2 in (0, 2); distinct per head."""
    for variant, (s1, s2) in {"log": (2.0, 1.0), "power": (1.0, 2.0)}.items():
        posenc = hf_posenc.patch_model(make_model("llama"), "kerple", variant=variant).posenc
        r1, r2 = posenc.r1[0], posenc.r2[0]
        expected = (torch.arange(4) + 0.5) / 4
        torch.testing.assert_close(r1, s1 * expected)
        torch.testing.assert_close(r2, s2 * expected.flip(0))


def test_fire_starts_with_a_zero_bias():
    """A freshly patched FIRE model adds no bias: the output layer of f starts at zero."""
    model = hf_posenc.patch_model(make_model("llama"), "fire")
    with torch.no_grad():
        bias = model.posenc.score_bias(probe_call(model.posenc.geometry, 20)).full()
    assert torch.equal(bias, torch.zeros_like(bias))
    assert float(model.posenc.functions[0].threshold().detach()) == 512.0
    assert float(model.posenc.functions[0].c.detach()) == pytest.approx(0.1)


def test_sandwich_diagonal_is_zero_and_bias_is_nonpositive():
    """p_i.p_i - d'/2 = 0 on the diagonal; elsewhere the bias is <= 0; head h is scaled by H/(8h)."""
    model = hf_posenc.patch_model(make_model("llama"), "sandwich")
    with torch.no_grad():
        bias = model.posenc.score_bias(probe_call(model.posenc.geometry, 50)).full()[0]  # (4, 50, 50)
    assert torch.equal(bias.diagonal(dim1=1, dim2=2), torch.zeros(4, 50))
    assert bool((bias <= 0).all())
    ratio = bias[0, 10, 3] / bias[3, 10, 3]
    assert float(ratio) == pytest.approx(4.0)  # (8*4/4) / (8*1/4)


def test_new_encodings_are_listed_with_their_parameters():
    infos = {info.name: info for info in hf_posenc.list_encodings()}
    assert infos["kerple"].parameters == {"variant": "log", "shared_across_layers": True, "scaling": None}
    assert infos["sandwich"].parameters == {"dim": 128, "scaling": None}
    assert infos["fire"].parameters == {
        "mlp_width": 32,
        "init_c": 0.1,
        "init_L": 512.0,
        "shared_across_layers": False,
        "scaling": None,
    }
    assert all(infos[n].stages == ("score_bias",) for n in ("kerple", "sandwich", "fire"))
    assert not list(hf_posenc.patch_model(make_model("gpt2"), "sandwich").posenc.parameters())


# -- parameter validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("kerple", {"variant": "cubic"}, r"variant='cubic'.*'log', 'power'"),
        ("kerple", {"shared_across_layers": 1}, r"shared_across_layers=1.*True or False"),
        ("sandwich", {"dim": 7}, r"dim=7.*even integer >= 2"),
        ("sandwich", {"dim": 0}, r"dim=0.*integer in \[2"),
        ("sandwich", {"dim": 64.0}, r"dim=64.0.*integer"),
        ("fire", {"mlp_width": 0}, r"mlp_width=0.*integer in \[1"),
        ("fire", {"init_c": -0.1}, r"init_c=-0.1.*number in \(0.0"),
        ("fire", {"init_L": 0.0}, r"init_L=0.0.*number in \(0.0"),
        ("fire", {"init_L": float("inf")}, r"init_L=inf"),
        ("fire", {"L": 3.0}, r"no parameter 'L'.*init_L=512.0"),
    ],
)
def test_bad_parameters_raise_with_value_and_allowed_range(name, params, match):
    with pytest.raises(hf_posenc.InvalidParameterError, match=match):
        hf_posenc.patch_model(make_model("llama"), name, **params)


def test_fire_score_bias_gives_the_mlp_bias_and_its_gradients():
    """FIRE's score bias, evaluated through the MLP's linear pieces (a few operations per score
    instead of a hidden layer per score), equals the plain MLP f(psi(i-j)/psi(max(L, i))) on every
    attendable (i, j), and every parameter receives the MLP's gradient."""
    model = patch(make_model("llama"), "fire", {"init_L": 40.0})  # L ~ 5: queries on both sides
    fn = model.posenc.functions[0]
    ctx = fire_context(model, 12, 12, 0)
    distance = torch.arange(12)[:, None] - torch.arange(12)[None, :]
    causal = distance >= 0
    weights = torch.linspace(-1, 1, 4 * int(causal.sum()))
    results = []
    for use_pieces in (True, False):
        fn.zero_grad()
        if use_pieces:
            bias = model.posenc.score_bias(ctx).full()  # (1, H, T, T)
        else:
            x = fn.normalized_distance(distance, ctx.positions)[..., None]
            bias = fn.mlp(x).permute(0, 3, 1, 2)  # (1, H, T, T)
        attendable = bias[0][:, causal]  # (H, entries)
        (attendable.reshape(-1) * weights).sum().backward()
        results.append((attendable.detach(), {n: p.grad.clone() for n, p in fn.named_parameters()}))
    (pieces, piece_grads), (mlp, mlp_grads) = results
    torch.testing.assert_close(pieces, mlp, atol=1e-6, rtol=1e-5)
    for n in mlp_grads:
        assert mlp_grads[n].abs().sum() > 0, n
        torch.testing.assert_close(piece_grads[n], mlp_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_fire_decoding_sees_mlp_values_changed_through_data():
    """FIRE keeps its MLP's linear pieces between forwards without gradients; an edit of the MLP
    through ``.data`` (no version counter moves) must reach the next forward: its logits equal
    those of a model freshly built with the edited values."""
    model = patch(make_model("llama"), "fire", {"init_L": 6.0})
    ids = token_ids(1, 20)
    with torch.no_grad():
        model(ids)  # pieces kept
        for parameter in model.posenc.parameters():
            parameter.data.add_(0.05 * torch.randn_like(parameter))
        logits = model(ids).logits
        fresh = patch(make_model("llama"), "fire", {"init_L": 6.0}, randomize=False)
        fresh.load_state_dict(model.state_dict())
        reference = fresh(ids).logits
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
