"""The layout conventions shared by encodings and attention backends, each written once.

Bottom-right alignment: query ``a`` of ``Tq`` sits at key index ``Tk - Tq + a`` (how a KV
cache lays out the new tokens after the cached ones), so query ``a`` may attend keys
``0 .. Tk - Tq + a`` and the query-key distance is ``i - j`` in key-index space.

Grouped-query attention: KV head ``g`` serves query heads ``g * groups .. (g + 1) * groups - 1``.

Masks: booleans, True where a key may be attended; a float attention mask holds the bias
where allowed and the dtype's minimum elsewhere (:func:`fold_mask`).
"""

from __future__ import annotations

import torch


def query_key_indices(
    q_len: int, k_len: int, device: torch.device | None, start: int = 0, stop: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key indices of queries ``start .. stop-1`` (bottom-right aligned, (rows,)) and of every key (Tk,)."""
    stop = q_len if stop is None else stop
    offset = k_len - q_len
    return (
        torch.arange(start + offset, stop + offset, device=device),
        torch.arange(k_len, device=device),
    )


def causal_keys(q_len: int, k_len: int, stop: int) -> int:
    """How many keys (``0 ..``) queries ``.. stop-1`` may attend: the key index of query ``stop-1``, plus one."""
    return k_len - q_len + stop


def query_key_distance(
    q_len: int, k_len: int, device: torch.device | None, start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """(rows, Tk) int64 matrix of ``i - j`` in key-index space for queries ``start .. stop-1``."""
    queries, keys = query_key_indices(q_len, k_len, device, start, stop)
    return queries[:, None] - keys[None, :]


def causal_mask(q_len: int, k_len: int, device: torch.device | None) -> torch.Tensor:
    """(1, 1, Tq, Tk) bool, bottom-right aligned: True where ``j <= i``."""
    return (query_key_distance(q_len, k_len, device) >= 0)[None, None]


def causal_mask_or_none(q_len: int, k_len: int, device: torch.device | None) -> torch.Tensor | None:
    """:func:`causal_mask`, or None where it masks nothing: one query, whose keys (bottom-right
    aligned) end at its own (a decoding step: no mask to build or fold)."""
    return None if q_len == 1 else causal_mask(q_len, k_len, device)


def own_key(q_len: int, k_len: int, device: torch.device | None) -> torch.Tensor:
    """(Tq, Tk) bool, True at each query's own key (``j == i``)."""
    return query_key_distance(q_len, k_len, device) == 0


def fold_mask(values: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Bias or scores ``values`` where ``allowed`` (broadcastable bool), the dtype's minimum elsewhere."""
    if allowed is None:
        return values
    return values.masked_fill(~allowed, torch.finfo(values.dtype).min)


def expand_kv_heads(x: torch.Tensor, groups: int, dim: int = 1) -> torch.Tensor:
    """Per-KV-head values -> per-query-head values: dim ``dim`` of size Hkv becomes Hkv * groups,
    each KV head repeated for the ``groups`` query heads it serves (no copy when ``groups == 1``)."""
    if groups == 1:
        return x
    dim = dim % x.ndim
    shape = list(x.shape)
    shape.insert(dim + 1, groups)
    return x.unsqueeze(dim + 1).expand(shape).flatten(dim, dim + 1)


def hankel_view(line: torch.Tensor, first: int, rows: int, keys: int) -> torch.Tensor:
    """line (H, L) -> the (1, H, rows, keys) view ``out[0, h, a, j] = line[h, first + a + j]``
    (row and column stride 1: every entry of an anti-diagonal is the same element)."""
    offset = line.storage_offset() + first
    return line.as_strided((1, line.shape[0], rows, keys), (0, line.stride(0), 1, 1), offset)


def anti_diagonal_sums(values: torch.Tensor) -> torch.Tensor:
    """(H, rows, keys) -> (H, rows + keys - 1): ``out[h, n]`` = the sum of ``values[h, a, j]`` over
    a + j = n (the gradient of a :func:`hankel_view`), read from the values skewed into an (H, rows,
    keys + rows) buffer (row a shifted right by a): one copy and one sum over the rows."""
    heads, rows, keys = values.shape
    width = keys + rows
    skewed = values.new_zeros(heads, rows, width)  # skewed[h, a, a + j] = values[h, a, j]
    skewed.as_strided((heads, rows, keys), (rows * width, width + 1, 1)).copy_(values)
    return skewed.sum(dim=1)[:, : width - 1]
