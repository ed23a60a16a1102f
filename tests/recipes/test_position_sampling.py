"""Position sampling (``train --position-sampling pose|randomized --target-length N``): the ids
against the papers' definitions, the mask they need, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_posenc
from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.training import TrainConfig
from hf_posenc.recipes.training.sampling import (
    check_encoding_reads_positions,
    document_mask,
    pose_positions,
    randomized_positions,
    sample_positions,
)

windows = st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(n, 4 * n + 10)))


@settings(max_examples=200, deadline=None)
@given(window=windows, seed=st.integers(0, 2**31))
def test_pose_ids_are_two_chunks_the_second_skipped_forward(window, seed):
    """PoSE (Zhu et al. 2024, the released code's two chunks): positions 0..l0-1 with
    1 <= l0 <= ceil(L/2), then l0+u .. L-1+u with 0 <= u <= N-L; all below N."""
    length, target = window
    ids = pose_positions(length, target, torch.Generator().manual_seed(seed)).tolist()
    assert len(ids) == length and ids[0] == 0
    jumps = [i for i in range(1, length) if ids[i] - ids[i - 1] != 1]
    assert len(jumps) <= 1  # at most one skip (none when u = 0, or when l0 = L = 1)
    if jumps:
        l0 = jumps[0]
        skip = ids[l0] - l0
        assert 1 <= l0 <= (length + 1) // 2 and 1 <= skip <= target - length
    assert all(b > a for a, b in zip(ids, ids[1:], strict=False)) and ids[-1] < target


@settings(max_examples=200, deadline=None)
@given(window=windows, seed=st.integers(0, 2**31))
def test_randomized_ids_are_a_sorted_sample_without_replacement(window, seed):
    """Ruoss et al. 2023: L distinct ids from 0..N-1 in increasing order."""
    length, target = window
    ids = randomized_positions(length, target, torch.Generator().manual_seed(seed)).tolist()
    assert len(ids) == length and len(set(ids)) == length
    assert ids == sorted(ids) and ids[0] >= 0 and ids[-1] < target


def test_randomized_ids_are_uniform_over_the_range():
    """Every id of 0..N-1 is drawn with probability L/N (2000 draws of 8 out of 32: 500 each)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(32)
    for _ in range(2000):
        counts[randomized_positions(8, 32, generator)] += 1
    assert counts.min() > 420 and counts.max() < 580


def test_pose_skips_are_uniform_over_their_range():
    """u ~ U{0..N-L}: each of the 5 skips of L=8, N=12 about 1/5 of the time."""
    generator = torch.Generator().manual_seed(0)
    skips = torch.zeros(5)
    for _ in range(2000):
        ids = pose_positions(8, 12, generator)
        skips[int(ids[-1]) - 7] += 1
    assert skips.min() > 330 and skips.max() < 470


def test_each_document_piece_gets_its_own_sample_and_runs_repeat_exactly():
    restarting = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    a = sample_positions("randomized", restarting, 100, seed=3, first_sequence=40)
    b = sample_positions("randomized", restarting, 100, seed=3, first_sequence=40)
    assert torch.equal(a, b)  # the same sequence index and seed: the same ids (resume, N processes)
    for row, pieces in ((0, [(0, 4), (4, 10)]), (1, [(0, 10)])):
        for start, stop in pieces:
            piece = a[row, start:stop].tolist()
            assert piece == sorted(set(piece)) and piece[-1] < 100
    # the second row is sequence 41: its own generator
    assert torch.equal(sample_positions("randomized", restarting[1:], 100, 3, 41), a[1:])


def test_document_mask_is_causal_within_each_document():
    restarting = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = document_mask(restarting)[0, 0]
    document = [0, 0, 0, 1, 1, 2]
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (j <= i and document[i] == document[j])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"position_sampling": "pose", "target_length": 32}, r"target_length=32 .* >= seq_len \(64\)"),
        ({"position_sampling": "pose"}, r"target_length=None .* >= seq_len"),
        ({"target_length": 1024}, r"target_length=1024 does nothing without --position-sampling"),
        (
            {"position_sampling": "yarn", "target_length": 1024},
            r"position_sampling='yarn'.*none, pose, randomized",
        ),
    ],
)
def test_bad_sampling_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(InvalidParameterError, match=message):
        TrainConfig(model="m", output_dir="o", seq_len=64, **overrides)


@pytest.mark.parametrize("encoding", ["alibi", "fox", "cope", "nope", "t5"])
def test_sampling_is_refused_for_encodings_that_read_no_position_ids(encoding):
    model = hf_posenc.patch_model(tiny_model("llama"), encoding)
    with pytest.raises(
        InvalidParameterError, match=rf"--position-sampling pose is not allowed with encoding '{encoding}'"
    ):
        check_encoding_reads_positions("pose", model.posenc)


def test_sampling_is_allowed_where_some_layer_reads_positions():
    check_encoding_reads_positions("pose", hf_posenc.patch_model(tiny_model("llama"), "rope").posenc)
    check_encoding_reads_positions(
        "randomized", hf_posenc.patch_model(tiny_model("llama"), "rope+nope").posenc
    )
    with pytest.raises(InvalidParameterError, match="'nope\\+alibi'"):
        check_encoding_reads_positions(
            "pose", hf_posenc.patch_model(tiny_model("llama"), "nope+alibi").posenc
        )


def test_a_study_row_with_a_pose_suffix_trains_with_pose_to_the_longest_evaluated_length(tmp_path):
    from hf_posenc.recipes.study.runs import _run_settings
    from hf_posenc.recipes.study.spec import StudyConfig, display_label

    config = StudyConfig(encodings=["rope", "rope~pose"], train_length=64, multiples=[1, 4, 16])
    plain = _run_settings(config, tmp_path / "base", "rope", tmp_path)
    posed = _run_settings(config, tmp_path / "base", "rope~pose", tmp_path)
    assert (plain.position_sampling, plain.target_length) == ("none", None)
    assert (posed.position_sampling, posed.target_length) == ("pose", 64 * 16)
    assert posed.encoding == "rope" and posed.output_dir != plain.output_dir
    assert display_label("rope~pose") == "rope + PoSE"


def test_a_study_row_sampling_an_encoding_without_positions_is_refused_in_one_line():
    from hf_posenc.recipes.study.run import check_row_sampling

    with pytest.raises(InvalidParameterError, match=r"row 'alibi~pose': position sampling is not allowed"):
        check_row_sampling("alibi~pose", "alibi", {})
    check_row_sampling("rope~randomized", "rope", {})
