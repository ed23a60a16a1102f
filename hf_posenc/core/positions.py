"""Token positions for one forward pass, computed once at the top of the decoder stack.

Positions follow transformers' rules, with one improvement: when the caller passes an
``attention_mask`` with padding and no ``position_ids``, positions count only real tokens
(``cumsum(mask) - 1``), so a left-padded batch is encoded exactly like each row alone.
``generate()`` already passes such positions; a plain forward now gets them too.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from ..errors import InvalidParameterError


@dataclasses.dataclass
class ForwardContext:
    """positions (B,T) of the new tokens; key_positions (B,past+T) of every key, if asked.

    ``coordinates`` (B|1,T,axes): N-D positions of the new tokens that the caller passed as
    ``position_coordinates`` (read by encodings with ``takes_coordinates``); None otherwise."""

    positions: torch.Tensor
    key_positions: torch.Tensor | None
    coordinates: torch.Tensor | None = None
    #: tokens already in the KV cache before this forward (0 without a cache); under torch.compile
    #: with a static cache, the cache's 0-d count (a host int would be data-dependent)
    past_length: int | torch.Tensor = 0


def positional_names(signature: inspect.Signature) -> tuple[str, ...]:
    """Names that positional arguments bind to, in order (computed once per forward signature)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in signature.parameters.values() if p.kind in kinds)


def bind_arguments(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to parameter names.

    By a precomputed name table rather than ``inspect.Signature.bind``, which torch.compile
    cannot trace (fullgraph compiled generation passes through here)."""
    if len(args) > len(names):
        raise TypeError(f"unexpected extra positional arguments: {len(args) - len(names)}")
    out = dict(zip(names, args, strict=False))
    out.update(kwargs)
    return out


def _past_length(past_key_values: Any) -> int | torch.Tensor:
    """Tokens in the cache: a host int, except under torch.compile when the cache counts in a
    tensor (a static cache's 0-d count: reading it on the host is data-dependent, which inductor
    cannot compile; a copy, since the cache adds to it in place during the forward)."""
    if past_key_values is None:
        return 0
    past = past_key_values.get_seq_length()
    if torch.is_tensor(past) and torch.compiler.is_compiling():
        return past.clone()
    return int(past)


def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 mask -> (B, L) positions counting real tokens only (padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def compute_context(
    *,
    batch: int,
    length: int,
    device: torch.device,
    attention_mask: Any,
    position_ids: torch.Tensor | None,
    past_key_values: Any,
    want_key_positions: bool,
) -> ForwardContext:
    past = _past_length(past_key_values)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 else None
    # No data-dependent branch on whether the mask has padding (torch.compile(fullgraph=True)
    # must trace this): positions counting real tokens equal arange(past, past+T) without padding.
    full: torch.Tensor | None = None  # positions of all past+new tokens, when derivable
    if mask is not None and not torch.is_tensor(past) and mask.shape[-1] == past + length:
        full = _mask_positions(mask.to(device))
    if position_ids is not None:
        positions = position_ids.to(device).expand(batch, -1)
    elif full is not None:
        positions = full[:, -length:]
    elif mask is not None and mask.shape[-1] == length:
        positions = _mask_positions(mask.to(device)) + past
    else:
        positions = (torch.arange(length, device=device) + past).unsqueeze(0).expand(batch, -1)

    key_positions = None
    # compiled over a static cache (past is a tensor): the attention derives them from the cache's
    # layout (attention/static_cache.py)
    if want_key_positions and isinstance(past, int):
        if past == 0:
            key_positions = positions
        elif full is not None:
            key_positions = full
        else:
            # Without a full-length mask the cached keys are taken to be contiguous.
            start = positions[:, :1] - past
            key_positions = start + torch.arange(past + length, device=device)
    return ForwardContext(positions=positions, key_positions=key_positions, past_length=past)


def select_coordinates(
    coordinates: Any, *, batch: int, length: int, device: torch.device, past_key_values: Any
) -> torch.Tensor:
    """The rows of ``position_coordinates`` (B|1, L, axes) that belong to this forward's T new tokens.

    ``generate()`` passes the same keyword at every step, so coordinates may cover every token
    (prompt and tokens still to come): rows ``past .. past+T`` are taken when ``L >= past + T``;
    coordinates of exactly the new tokens (``L == T``) are taken as they are."""
    if (
        not isinstance(coordinates, torch.Tensor)
        or coordinates.ndim != 3
        or coordinates.shape[0] not in (1, batch)
    ):
        shape = (
            tuple(coordinates.shape) if isinstance(coordinates, torch.Tensor) else type(coordinates).__name__
        )
        raise InvalidParameterError(
            f"position_coordinates={shape} is not allowed; allowed: a tensor (batch or 1, tokens, axes), "
            f"batch={batch}"
        )
    past, have = _past_length(past_key_values), coordinates.shape[1]
    if torch.is_tensor(past) and have != length:  # compiled over a static cache: rows past .. past+T
        return coordinates.to(device).index_select(1, torch.arange(length, device=device) + past.to(device))
    if have >= past + length:
        return coordinates[:, past : past + length].to(device)
    if have == length:
        return coordinates.to(device)
    raise InvalidParameterError(
        f"position_coordinates covers {have} tokens, but this forward needs the coordinates of tokens "
        f"{past}..{past + length - 1} (or exactly its {length} new tokens); with generate(), pass "
        "coordinates for the prompt and every token to be generated"
    )
