"""A per-forward memo for values that every layer shares (biases, cos/sin, bucket indices).

Entries are tensors or values built from them (a score-bias form, a (cos, sin) pair); ``get``
returns the type its ``compute`` returns. Only values that carry no gradient belong here: they are pure functions of positions and
shapes, so reusing them across layers (and in gradient-checkpoint recomputation) is exact.
The memo empties itself whenever a new forward pass starts.

``carry`` is a separate per-forward dict for values that flow from one layer to the next
(TAPE's positional stream): they may carry gradients, so they never go through ``get``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Value = TypeVar("Value")


class ForwardMemo:
    def __init__(self) -> None:
        self._owner: object | None = None
        self._values: dict[Hashable, object] = {}
        #: per-forward values handed from layer to layer (may require grad); emptied with the memo
        self.carry: dict[Hashable, torch.Tensor] = {}

    def start(self, owner: object) -> None:
        """Begin a new forward pass identified by ``owner`` (its position tensor)."""
        if torch.compiler.is_compiling():
            # every compiled call is a new forward; comparing with the last owner would make
            # dynamo guard on it (None after a compiled call, a tensor after an eager one: one
            # recompilation of transformers' compiled decoding step)
            self.clear()
            return
        if owner is not self._owner:
            self._owner = owner
            self._values = {}
            self.carry = {}

    def get(self, key: Hashable, compute: Callable[[], Value]) -> Value:
        """The value memoised under ``key`` in this forward, computed by ``compute`` the first time."""
        if torch.compiler.is_compiling():
            # inside torch.compile the graph shares repeated work itself; a Python-side cache would
            # be a data-dependent branch (fullgraph) and would keep CUDA-graph outputs alive across
            # replays (transformers' compiled generation), which the next replay overwrites
            return compute()
        if key in self._values:
            return self._values[key]  # type: ignore[return-value]  # stored by compute() under this key
        value = compute()
        self._values[key] = value
        return value

    def holds(self, value: object) -> bool:
        """Whether ``value`` itself is one of this forward's memoised values (so it is shared and alive)."""
        if torch.compiler.is_compiling():
            return False
        return any(stored is value for stored in self._values.values())

    def release(self) -> None:
        """Drop the memoised tensors after a forward; ``carry`` stays for gradient-checkpoint
        recomputation, which replays layers after the forward has returned."""
        self._values = {}

    def clear(self) -> None:
        self._owner = None
        self._values = {}
        self.carry = {}
