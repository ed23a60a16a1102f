"""The training-free extensions of a RoPE checkpoint that split attention at a window w
(SelfExtend, ReRoPE, Leaky ReRoPE): neighbours (i - j < w) keep RoPE at (i, j), far keys are seen
at the pair of positions their encoding's map gives. The layer's native RoPE (theta as the config
states it) is used; natively position-free layers stay so."""

from __future__ import annotations

from collections.abc import Callable

from .attention import two_map_attention_layer
from .config import native_rope, native_window
from .rope import reference_inv_freq, rotation_matrix

PositionMap = Callable[[int, int], tuple[float, float]]


def split_layer_reference(
    params: dict, module, hidden, model, layer_idx: int, positions: PositionMap, query_scale=None
):
    """One attention layer in fp64 with (query, key) positions ``positions(i, j)`` (and queries
    multiplied by ``query_scale(i)`` when given)."""
    theta, rotates = native_rope(model, layer_idx)
    rotation = None
    if rotates:
        inv_freq, factor = reference_inv_freq(
            {**params, "theta": theta}, module.head_dim, seq_len=hidden.shape[1]
        )
        rotation = lambda p: rotation_matrix(p, inv_freq, module.head_dim, factor)  # noqa: E731
    return two_map_attention_layer(
        module,
        hidden,
        softmax_scale=module.scaling,
        window=native_window(model, layer_idx),
        rotation=rotation,
        positions=positions,
        query_scale=query_scale,
    )


def default_window(params: dict, model) -> int:
    """The window w: as given, else a quarter of the trained length (the config's max positions)."""
    return params.get("window", model.config.max_position_embeddings // 4)
