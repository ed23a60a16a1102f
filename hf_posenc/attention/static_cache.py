"""The keys of a pre-allocated (static) KV cache as the attention stages read them.

A static cache (transformers' ``StaticCache``, ``generate(cache_implementation="static")``)
returns its whole buffer of ``S`` slots from ``update``: slot ``j`` holds the ``j``-th key
written, the slots past the written count ``n`` are zeros that transformers' mask hides
(queries at slots ``n - Tq .. n - 1``). hf_posenc's stages read queries bottom-right aligned to
the keys (:mod:`hf_posenc.core.layout`), so the buffer is brought to that layout:

- not compiling: ``n`` is read on the host and the written slots are kept (``[:n]``), as a
  dynamic cache would hold them;
- compiled (``torch.compile``, transformers' compiled decoding step): ``n`` lives in a 0-d
  tensor of the cache, and a key count sliced by it is data-dependent (inductor refuses it,
  ``fullgraph=True`` fails, and a host read would recompile at every step). Shapes stay ``S``:

  * an attention that reads no positions (the encoding's positions are already inside q and k:
    rotations, input codes) attends the whole buffer under transformers' mask, as the native
    model does;
  * one that reads positions (score biases, explicit scores, a ``logits`` stage, a positional
    stream) gets the buffer rolled so the written keys end the key axis,
    ``rolled[r] = buffer[(r + n) mod S]``: the unwritten slots come first and stay masked, and
    written key ``j`` sits at ``S - n + j``, so every query-key distance (``past + a - j``) is
    the dynamic cache's.

A static sliding-window layer keeps a host count (``compat.static_layer_written``); its keys are
sliced by it in both modes (an int: transformers recompiles those layers' steps too).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import static_layer_written


class StaticKeys:
    """The keys, values and mask one layer attends over a static cache, and how to map the
    attention weights back to the cache's slots."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        order: torch.Tensor | None,
        allocated: int,
    ) -> None:
        self.k, self.v, self.mask = k, v, mask  # (B, Hkv, Tk, D), (B, Hkv, Tk, Dv), (B|1, 1, Tq, Tk) bool
        #: the cache's slots S
        self.allocated = allocated
        #: (S,) slot of each attended key when the buffer was rolled, else None
        self.order = order

    def weights_over_slots(self, weights: torch.Tensor) -> torch.Tensor:
        """(B, H, Tq, Tk) weights over the attended keys -> (B, H, Tq, S) over the cache's slots
        (unwritten slots 0), the shape native attention maps have over a static cache."""
        if self.order is not None:  # rolled: key r holds slot order[r]; scatter back
            return torch.zeros_like(weights).index_copy_(-1, self.order, weights)
        if weights.shape[-1] < self.allocated:
            return torch.nn.functional.pad(weights, (0, self.allocated - weights.shape[-1]))
        return weights


def static_cache_keys(
    cache: Any,
    layer_idx: int,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    past: int | torch.Tensor,
    new: int,
    reads_positions: bool,
) -> StaticKeys:
    """``k``/``v`` (B, Hkv, S, D): what the static cache's ``update`` returned for this layer;
    ``mask`` (B|1, 1, Tq, S) bool or None; ``past``: keys cached before this forward (a host
    int, or the cache's 0-d count under torch.compile); ``new``: this forward's tokens;
    ``reads_positions``: whether the attention reads query/key positions (see the module)."""
    allocated = k.shape[-2]
    sliding = static_layer_written(cache, layer_idx)
    if sliding is not None or not torch.is_tensor(past):
        valid = min(sliding if sliding is not None else past + new, allocated)
        return StaticKeys(
            k[:, :, :valid], v[:, :, :valid], None if mask is None else mask[..., :valid], None, allocated
        )
    written = past + new  # 0-d tensor: keys in the buffer after this update
    slots = torch.arange(allocated, device=k.device)  # (S,)
    if mask is None:  # query a (slot written - new + a) attends slots 0 .. written - new + a
        query_slots = written - new + torch.arange(new, device=k.device)  # (Tq,)
        mask = (slots[None, :] <= query_slots[:, None])[None, None]  # (1, 1, Tq, S)
    if not reads_positions:
        return StaticKeys(k, v, mask, None, allocated)
    order = (slots + written) % allocated  # (S,): rolled key r holds slot order[r]
    return StaticKeys(
        k.index_select(2, order), v.index_select(2, order), mask.index_select(-1, order), order, allocated
    )


def rolled_key_positions(positions: torch.Tensor, allocated: int) -> torch.Tensor:
    """(B, S) positions of the rolled keys: the written keys, contiguous, end with the last query's
    position (the unwritten, masked slots before them get smaller, possibly negative ones)."""
    return positions[:, -1:] - (allocated - 1) + torch.arange(allocated, device=positions.device)
