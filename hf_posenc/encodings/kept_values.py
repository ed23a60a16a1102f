"""Values an encoding derives from its parameters without gradients, kept from one forward to the
next while those parameters keep their values.

A cached decoding step would otherwise derive them again in every layer for every token
(LieRE's and ComRoPE's ``eigh`` of their generators, which on a GPU also waits for the host to
read a separation check; FIRE's linear pieces of its MLP). Each use compares the inputs with the
copies kept beside the value (``torch.equal``): any change of value, however it was made (an
optimizer step, a ``load_state_dict``, an edit through ``.data``, which moves no version
counter), gets a new value, so nothing stale is ever used. Under torch.compile (no
data-dependent comparison there) the value is derived every time. Values made under
``torch.inference_mode`` are kept apart and used there only: an inference tensor may not enter
a computation autograd records (a later training step with frozen parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class KeptValues:
    """``get(key, inputs, derive)``: ``derive(*inputs)``, or what it gave before under ``key`` for
    inputs of equal values (shape, dtype, device and every element)."""

    def __init__(self) -> None:
        self._kept: dict[object, tuple[tuple[torch.Tensor, ...], object]] = {}

    def get(self, key: object, inputs: tuple[torch.Tensor, ...], derive: Callable[..., T]) -> T:
        if torch.compiler.is_compiling():
            return derive(*inputs)
        key = (key, torch.is_inference_mode_enabled())
        kept = self._kept.get(key)
        if kept is not None and len(kept[0]) == len(inputs) and all(map(_equal, kept[0], inputs)):
            return kept[1]  # type: ignore[return-value]
        value = derive(*inputs)
        self._kept[key] = (tuple(t.detach().clone() for t in inputs), value)
        return value


def _equal(kept: torch.Tensor, now: torch.Tensor) -> bool:
    return (
        kept.shape == now.shape
        and kept.dtype == now.dtype
        and kept.device == now.device
        and torch.equal(kept, now)
    )
