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


@dataclasses.dataclass
class ForwardContext:
    """positions (B,T) of the new tokens; key_positions (B,past+T) of every key, if asked."""

    positions: torch.Tensor
    key_positions: torch.Tensor | None


def bind_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's positional and keyword arguments to parameter names (``**kwargs`` flattened)."""
    bound = signature.bind_partial(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        param = signature.parameters[name]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"unexpected extra positional arguments: {len(value)}")
        else:
            out[name] = value
    return out


def _past_length(past_key_values: Any) -> int:
    if past_key_values is None:
        return 0
    return int(past_key_values.get_seq_length())


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
    padded = mask is not None and not bool(mask.bool().all())

    full: torch.Tensor | None = None  # positions of all past+new tokens, when derivable
    if padded and mask.shape[-1] == past + length:
        full = _mask_positions(mask.to(device))
    if position_ids is not None:
        positions = position_ids.to(device).expand(batch, -1)
    elif full is not None:
        positions = full[:, -length:]
    elif padded and mask.shape[-1] == length:
        positions = _mask_positions(mask.to(device)) + past
    else:
        positions = torch.arange(past, past + length, device=device).unsqueeze(0).expand(batch, -1)

    key_positions = None
    if want_key_positions:
        if past == 0:
            key_positions = positions
        elif full is not None:
            key_positions = full
        else:
            # Without a full-length mask the cached keys are taken to be contiguous.
            start = positions[:, :1] - past
            key_positions = start + torch.arange(past + length, device=device)
    return ForwardContext(positions=positions, key_positions=key_positions)
