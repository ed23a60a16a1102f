"""``core.decoding_state.appended``: a decoding-state entry grown in place. Whatever the cache does
to the entry between steps (crop it, reorder or select its rows, slide its window), the result
equals ``torch.cat`` of the entry as it stands and the new tokens, and the entries returned
earlier keep the values they had (but after a crop, which rolls the tokens past it back: their
room is written again).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.core.decoding_state import appended

#: one step: append n tokens, then maybe an operation of the cache on the entry
OPERATIONS = st.sampled_from(["none", "crop", "reorder", "select", "slide"])


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(1, 5), OPERATIONS), min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_appended_equals_concatenation_whatever_the_cache_did(steps, seed):
    generator = torch.Generator().manual_seed(seed)
    entry = torch.randn(2, 3, 4, 5, generator=generator)  # (B, H, T, D)
    reference = entry.clone()
    history: list[tuple[torch.Tensor, torch.Tensor]] = []  # (returned entry, its values then)
    rolled_back: set[int] = set()  # entries in history that a later crop rolled back
    for count, operation in steps:
        new = torch.randn(2, 3, count, 5, generator=generator)
        entry = appended(entry, new)
        reference = torch.cat((reference, new), dim=-2)
        torch.testing.assert_close(entry, reference, atol=0, rtol=0)
        history.append((entry, entry.clone()))
        if operation == "crop" and entry.shape[-2] > 2:
            entry, reference = entry.narrow(-2, 0, entry.shape[-2] - 2), reference[..., :-2, :]
            rolled_back.update(range(len(history)))
        elif operation == "reorder":
            order = torch.tensor([1, 0])
            entry, reference = entry.index_select(0, order), reference.index_select(0, order)
        elif operation == "select":
            entry, reference = entry[torch.tensor([1, 1])], reference[torch.tensor([1, 1])]
        elif operation == "slide" and entry.shape[-2] > 3:
            entry, reference = entry[..., 3:, :], reference[..., 3:, :]
    for index, (returned, values) in enumerate(history):  # later appends wrote past their ends only
        if index not in rolled_back:
            torch.testing.assert_close(returned, values, atol=0, rtol=0)


def test_appending_one_token_at_a_time_copies_the_entry_a_logarithmic_number_of_times():
    """Token-by-token growth reuses one buffer until it is full, then grows it by a quarter (at
    least 64 rows): appending 1000 tokens to a 64-token entry allocates a buffer about
    log(1064 / 64) / log(1.25) + 1 ~ 14 times, not 1000, and leaves at most a quarter (or 64
    rows) of it unused."""
    entry = torch.zeros(1, 2, 64, 4)
    buffers = set()
    for _ in range(1000):
        entry = appended(entry, torch.ones(1, 2, 1, 4))
        buffers.add(entry.untyped_storage().data_ptr())
    assert entry.shape == (1, 2, 1064, 4) and bool((entry[..., 64:, :] == 1).all())
    assert len(buffers) <= 16
    assert entry._base.shape[-2] <= 1064 + max(1064 // 4, 64)


def test_a_sliding_window_appends_in_place_until_its_room_is_used():
    """A window that keeps its last 100 tokens (a sliding-window cache drops the oldest key each
    step) grows in place too: 1000 steps allocate a buffer about 1000 / 64 times (the room left
    after each copy), not 1000, and every step equals the concatenation."""
    entry = torch.arange(100.0)[None, None, :, None].expand(1, 2, 100, 3).contiguous()
    reference = entry.clone()
    buffers = set()
    for step in range(1000):
        new = torch.full((1, 2, 1, 3), float(100 + step))
        entry = appended(entry, new)[..., -100:, :]
        reference = torch.cat((reference, new), dim=-2)[..., -100:, :]
        buffers.add(entry.untyped_storage().data_ptr())
    torch.testing.assert_close(entry, reference, atol=0, rtol=0)
    assert len(buffers) <= 1000 // 64 + 2
