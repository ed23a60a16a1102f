"""Per-layer decoding state of stateful encodings (FoX's cumulative forget gates, FoX Pro's
token shift), stored on the KV cache object itself so it follows everything transformers does
with the cache.

The state lives in ``cache.__dict__`` (so ``copy.deepcopy`` of a cache copies it), and the
cache's batch and length operations are followed: ``reorder_cache`` (beam search),
``batch_repeat_interleave`` / ``batch_select_indices`` (expansion and selection of rows) and
``crop`` (assisted and prompt-lookup decoding roll back rejected tokens). transformers has no
hook for these, so the first time a patched model meets a cache it wraps those methods on
that instance with :class:`FollowCache` objects.

An entry is a tensor with the batch in dim 0. An encoding says, per state key, along which
dim the entry is aligned with the cached keys (``sequence_dims``); ``crop`` shortens those
entries. An entry without such a dim (e.g. "the last raw key") cannot be rolled back, so a
crop of a cache holding one raises a clear error instead of decoding from a wrong state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModelError

STATES_ATTRIBUTE = "_hf_posenc_decoding_states"
FOLLOWED_METHODS = ("reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop")


class CacheStates:
    """Every patched model's decoding state on one cache: ``{token: {layer_idx: {key: tensor}}}``,
    plus, per token, which dim of each key is aligned with the cached tokens (None: not croppable)."""

    def __init__(self) -> None:
        self.layers: dict[str, dict[int, dict[str, Any]]] = {}
        self.sequence_dims: dict[str, dict[str, int | None]] = {}
        self.owners: dict[str, str] = {}

    def entries(self):
        for token, layers in self.layers.items():
            for state in layers.values():
                for key in list(state):
                    yield token, state, key

    def map_batch(self, function) -> None:
        for _, state, key in self.entries():
            value = state[key]
            if isinstance(value, torch.Tensor):
                state[key] = function(value)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove >= 0:  # 0: nothing; positive: transformers' legacy absolute form, refused by it
            return
        for token, state, key in self.entries():
            dim = self.sequence_dims.get(token, {}).get(key)
            if dim is None:
                raise UnsupportedModelError(
                    f"{self.owners.get(token, 'this encoding')}: the KV cache was cropped (assisted or "
                    f"prompt-lookup decoding), but its decoding state {key!r} cannot be rolled back; "
                    "use greedy, sampling or beam search decoding with this encoding"
                )
            value = state[key]
            state[key] = value.narrow(dim, 0, max(value.shape[dim] + tokens_to_remove, 0))


class FollowCache:
    """Instance-level wrapper of one cache method: updates the decoding states, then calls the
    class's own method. An object (not a closure) so a deep-copied cache wraps its own states."""

    def __init__(self, cache: Any, method: str) -> None:
        self.cache, self.method = cache, method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        states: CacheStates | None = self.cache.__dict__.get(STATES_ATTRIBUTE)
        if states is not None:
            _follow(states, self.method, *args, **kwargs)
        return getattr(type(self.cache), self.method)(self.cache, *args, **kwargs)


def _follow(states: CacheStates, method: str, *args: Any, **kwargs: Any) -> None:
    argument = args[0] if args else next(iter(kwargs.values()))
    if method == "reorder_cache":
        states.map_batch(lambda value: value.index_select(0, argument.to(value.device)))
    elif method == "batch_select_indices":
        states.map_batch(
            lambda value: value[argument.to(value.device) if torch.is_tensor(argument) else argument]
        )
    elif method == "batch_repeat_interleave":
        states.map_batch(lambda value: value.repeat_interleave(argument, dim=0))
    elif method == "crop":
        states.crop(int(argument))


def layer_state(
    cache: Any, token: str, layer_idx: int, sequence_dims: dict[str, int | None], owner: str
) -> dict[str, Any]:
    """This layer's state dict on ``cache`` for the patch identified by ``token`` (created empty)."""
    states: CacheStates | None = cache.__dict__.get(STATES_ATTRIBUTE)
    if states is None:
        states = CacheStates()
        cache.__dict__[STATES_ATTRIBUTE] = states
        for method in FOLLOWED_METHODS:
            if hasattr(type(cache), method):
                cache.__dict__[method] = FollowCache(cache, method)
    states.sequence_dims.setdefault(token, sequence_dims)
    states.owners.setdefault(token, owner)
    return states.layers.setdefault(token, {}).setdefault(layer_idx, {})


#: the least room a grown state entry leaves after its rows (:func:`appended`)
SPARE_ROWS = 64


def appended(kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``torch.cat((kept, new), dim=-2)`` for a state entry that grows by each step's tokens, in
    amortised O(new) time: the result is a view of a buffer with room to spare after it (a
    quarter more than it holds, at least :data:`SPARE_ROWS`: a new buffer every ~L/4 steps, each
    value copied about 4 times in all, and at most ~25 % of the entry unused), and ``kept``, when
    it is such a view with room after it (also one that a sliding window or a crop cut down),
    gets ``new`` written into that room (past its own end: ``kept`` itself reads the same values
    as before). A kept entry that is not such a view (reordered or selected by the cache's
    operations) is copied into a new buffer once. kept (..., T, D), new (..., n, D)."""
    length, count = kept.shape[-2], new.shape[-2]
    base = kept._base
    if (
        base is not None
        and base.shape[:-2] == kept.shape[:-2]
        and base.shape[-1] == kept.shape[-1]
        and base.stride() == kept.stride()
        and base.dtype == new.dtype
    ):
        # where kept starts in the buffer: a whole number of rows in (a view along the tokens only)
        first, rest = divmod(int(kept.storage_offset() - base.storage_offset()), int(base.stride(-2)))
        if rest == 0 and first >= 0 and first + length + count <= base.shape[-2]:
            base[..., first + length : first + length + count, :] = new
            return base[..., first : first + length + count, :]
    rows = length + count
    buffer = kept.new_empty(*kept.shape[:-2], rows + max(rows // 4, SPARE_ROWS), kept.shape[-1])
    buffer[..., :length, :] = kept
    buffer[..., length:rows, :] = new
    return buffer[..., :rows, :]
