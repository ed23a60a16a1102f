"""Head-parallel attention (DeepSpeed Ulysses' layout, issue 22 item 3): each of N ranks holds T/N
tokens, attends Hq/N heads over all T tokens, and takes every per-head quantity of the encoding
for its global heads ``rank * Hq/N ..``.

The property that matters is run with two CPU processes (gloo): a 2-rank training step's loss and
every gradient equal the one-process step of the same model on the unsharded batch, for score
biases (ALiBi, T5, KERPLE, Sandwich, FIRE, FoX), rotations, layer inputs, a hybrid, GQA and MHA,
and two families. Every encoding's per-head parameters are perturbed head by head first, so a wrong
head offset changes the result (checked by hand: with offset 0 on every rank the ALiBi, T5, FIRE
and FoX cases differ by 2e-2 .. 1e-1). Beside it, single-process checks: a bias form restricted to
a head range is those heads of the full form; which encodings are served, against a table written
from the papers' attention forms; and every refusal in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_two_processes
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.attention.head_parallel import HeadParallel, head_parallel_refusal
from hf_posenc.encodings.base import probe_call
from hf_posenc.errors import InvalidParameterError, NotPatchedError
from hf_posenc.models.base import ModelGeometry
from hf_posenc.recipes.tiny import tiny_model
from tests.encoding_cases import BLOCK_CASES, CASES_BY_ENCODING, HEAD_PARALLEL_SERVED, head_parallel_serves

WORKER = Path(__file__).with_name("head_parallel_worker.py")

CASES = [case for cases in CASES_BY_ENCODING.values() for case in cases]


def test_the_table_covers_every_registered_encoding():
    from hf_posenc.core.registry import encoding_names

    assert set(HEAD_PARALLEL_SERVED) == set(encoding_names())


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_head_parallel_serves_exactly_the_encodings_split_by_heads(name, params):
    from hf_posenc.recipes.training.parallelism import probe_encodings

    refusals = [head_parallel_refusal(instance) for instance in probe_encodings(name, params)]
    assert all(refusal is None for refusal in refusals) == head_parallel_serves(name, params), refusals


# -- a bias form restricted to a head range ----------------------------------------------------------
GEOMETRY = ModelGeometry(
    family="probe",
    hidden_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    max_position_embeddings=256,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
)


def _bias_encoding(name: str, params: dict):
    from hf_posenc.core.request import plan_request

    plan = plan_request(name, GEOMETRY.num_layers, params or None)
    [(cls, config)] = plan.parts
    encoding = cls(config.resolve(GEOMETRY), GEOMETRY)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # distinct heads (T5 tables and FoX gate weights start at 0)
        for parameter in encoding.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return encoding


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(BLOCK_CASES),
    heads=st.tuples(st.integers(0, 7), st.integers(1, 8)).filter(lambda h: h[0] < h[1]),
    q_len=st.integers(1, 12),
)
def test_a_bias_restricted_to_heads_is_those_heads_of_the_full_bias(case, heads, q_len):
    """For every score-bias encoding, ``heads(a, b)`` of its form is heads a .. b-1 of the full
    (Hq, T, T) bias, in every view a backend reads (the matrix, a span of keys, per score); no
    cached keys, as head-parallel attention runs."""
    name, params = case
    start, stop = heads
    call = probe_call(GEOMETRY, q_len, q_len, layer_idx=1)
    call = dataclasses.replace(
        call, hidden=torch.randn(call.hidden.shape, generator=torch.Generator().manual_seed(4))
    )
    with torch.no_grad():
        form = _bias_encoding(name, params).score_bias(call)
        full = form.full()  # (B|1, Hq, Tq, Tk)
        part = form.heads(start, stop)
        torch.testing.assert_close(part.full(), full[:, start:stop], rtol=0, atol=0)
        k_start = min(1, q_len - 1)
        torch.testing.assert_close(
            part.span(0, q_len, k_start, q_len), full[:, start:stop, :, k_start:], rtol=0, atol=0
        )
        # the chunked backend's block (mask folded in) and leading distance table
        # (B|1, Hq, Tq, Tk); cloned: a block may live in a scratch buffer the next block reuses
        folded = form.folded(0, q_len, 0, q_len, None, torch.float32).clone()
        # (FIRE's blocks are matrix products over every head at once: equal up to summation order)
        torch.testing.assert_close(
            part.folded(0, q_len, 0, q_len, None, torch.float32), folded[:, start:stop], rtol=1e-6, atol=1e-6
        )
        table = form.distance_table()
        if table is not None:
            part_table = part.distance_table()
            assert part_table is not None and part_table[0] == table[0]
            torch.testing.assert_close(part_table[1], table[1][start:stop], rtol=0, atol=0)
        score = part.elementwise()
        if score is not None:
            b, h, i, j = (
                torch.zeros((), dtype=torch.long),
                torch.tensor(stop - start - 1),
                torch.tensor(q_len - 1),
                0,
            )
            value = score(b, h, i, torch.tensor(j))
            torch.testing.assert_close(value, full[0, stop - 1, q_len - 1, j], rtol=1e-6, atol=1e-6)


# -- the property that matters: 2 ranks == 1 process -------------------------------------------------
TWO_RANK_CASES = [
    ("llama", "alibi", {}, 4, 2),
    ("llama", "alibi", {}, 4, 4),  # MHA
    ("llama", "t5", {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}, 4, 2),
    ("llama", "kerple", {"variant": "power", "shared_across_layers": False}, 4, 2),
    ("llama", "sandwich", {}, 4, 2),
    ("llama", "fire", {"init_L": 6.0}, 4, 2),
    ("llama", "fox", {}, 4, 2),
    ("llama", "rope", {}, 4, 2),
    ("llama", "expe", {}, 4, 2),
    ("llama", "rope+alibi", {}, 4, 2),  # a hybrid: one layer each
    ("gpt2", "t5", {}, 4, 4),
    # explicit score stages that treat every head alike, on their block backends (rows / neighbour:
    # query blocks of 4 so the 16 tokens make four) and on the eager path
    ("llama", "cope", {"query_block": 4}, 4, 2),
    ("llama", "sba", {"query_block": 4}, 4, 2),
    ("llama", "selfextend", {"group_size": 2, "window": 4, "query_block": 4}, 4, 2),
    ("llama", "rerope", {"window": 3, "query_block": 4}, 4, 2),
    ("llama", "leaky_rerope", {"window": 3, "leak": 4.0}, 4, 2),
    ("llama", "cope", {"backend": "eager"}, 4, 2),
]


@pytest.mark.slow
def test_a_two_rank_step_equals_the_one_process_step(tmp_path):
    cases = [
        {"family": f, "encoding": e, "params": p, "heads": h, "kv_heads": kv, "length": 16}
        for f, e, p, h, kv in TWO_RANK_CASES
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_two_processes(WORKER, str(tmp_path / "out.json"), str(tmp_path / "cases.json"))
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["case"] for r in results] == cases
    for r in results:
        label = f"{r['case']['family']}/{r['case']['encoding']}/kv={r['case']['kv_heads']}"
        parallel, single = r["loss"]
        assert abs(parallel - single) <= 1e-5 * abs(single), label
        assert r["parallel_names"] == r["names"], label  # every trained tensor got a gradient
        if r["case"]["encoding"] in ("t5", "kerple", "fire", "fox"):  # their per-head parameters are trained
            assert any(name.startswith("posenc") for name in r["names"]), label
        for name, error in r["max_error"].items():
            assert error <= 1e-5 * max(1.0, r["scale"][name]), (label, name, error)


# -- refusals and the one-rank plumbing ------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    """A one-process gloo group: the exchange is the identity, the checks around it run."""
    if dist.is_initialized():  # pragma: no cover - another test left a group
        pytest.fail("a torch.distributed process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _patched(encoding: str = "alibi"):
    model = tiny_model("llama", vocab_size=64)
    hf_posenc.patch_model(model, encoding)
    return model


def test_one_rank_is_the_plain_forward(one_rank_group):
    model = _patched("fox")
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10).expand_as(ids)
    expected = model(input_ids=ids, position_ids=positions).logits
    with hf_posenc.head_parallel(model):
        got = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(got, expected)


def test_positions_that_do_not_run_through_the_sequence_are_refused(one_rank_group):
    model = hf_posenc.enable_head_parallel(_patched())
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(InvalidParameterError, match="position ids") as error:
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    assert "\n" not in str(error.value)


def test_a_padding_mask_is_refused(one_rank_group):
    model = hf_posenc.enable_head_parallel(_patched())
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(InvalidParameterError, match="padding"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(8).expand_as(ids))


def test_decoding_with_cached_keys_is_refused(one_rank_group):
    model = _patched()
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = model(input_ids=ids, use_cache=True).past_key_values
    hf_posenc.enable_head_parallel(model)
    with pytest.raises(InvalidParameterError, match="cached keys"):
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_an_encoding_not_split_by_heads_is_one_line(one_rank_group):
    model = _patched("cape")  # its MLP mixes every head's scores
    with pytest.raises(InvalidParameterError, match="'cape'") as error:
        hf_posenc.enable_head_parallel(model)
    assert "allowed:" in str(error.value) and "\n" not in str(error.value)


def test_it_needs_a_patched_model_and_a_process_group():
    with pytest.raises(NotPatchedError):
        hf_posenc.enable_head_parallel(tiny_model("llama"))
    if not dist.is_initialized():
        with pytest.raises(InvalidParameterError, match="process group"):
            HeadParallel.of()


def test_it_is_not_copied(one_rank_group):
    import copy

    model = hf_posenc.enable_head_parallel(_patched())
    twin = copy.deepcopy(model)  # the setting holds a process group: it stays with the original
    ids = torch.randint(3, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    # the copy attends every head over its own tokens: position ids restarting are accepted
    twin(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
