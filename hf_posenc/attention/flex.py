"""The FlexAttention backend for block biases.

FlexAttention (``torch.nn.attention.flex_attention``) fuses the bias into the attention
kernel: ``score_mod(score, b, h, q_idx, kv_idx)`` adds the bias of each score, which every
bias form that can say it per score gives (:meth:`BlockBias.elementwise`: a distance table,
separable terms, FIRE's pieces), and a block mask skips the future (and padding).
On CUDA the function is compiled once (``torch.compile``); elsewhere it runs uncompiled,
which is exact but materialises the scores (for tests, not for speed) and has no backward.
Causal block masks are cached per (Tq, Tk, device); padding masks per forward.

:func:`attend_flex` reports ``None`` when it cannot serve a call, and the dispatcher falls back
to the chunked backend. A compile failure is remembered per patched model (the call's
``failures``), so one model's failure never switches FlexAttention off for another.

Registered as backend ``flex``: under ``backend="flex"``, and ``"auto"`` on CUDA.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from ..core.memo import ForwardMemo
from ..encodings.block_bias import BlockBias
from .backend import AUTO, AttentionCall, Backend, output_only, register_backend

_BLOCK_MASKS: dict[tuple, object] = {}
_BLOCK_MASK_LIMIT = 16


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _flex_function(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _block_mask(mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = k_len - q_len
    if mask is None:
        key = (q_len, k_len, str(device))
        cached = _BLOCK_MASKS.get(key)
        if cached is None:
            if len(_BLOCK_MASKS) >= _BLOCK_MASK_LIMIT:
                _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))

            def causal(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

            cached = create_block_mask(causal, None, None, q_len, k_len, device=device)
            _BLOCK_MASKS[key] = cached
        return cached

    allowed = mask.expand(batch, 1, q_len, k_len)  # (B, 1, Tq, Tk) bool, causal already

    def padded(b, h, q_idx, kv_idx):
        return allowed[b, 0, q_idx, kv_idx]

    return create_block_mask(padded, batch, None, q_len, k_len, device=device)


def _score_mod(bias: BlockBias) -> Callable | None:
    """``score + bias`` per score, or None when the bias form cannot say it per score."""
    elementwise = bias.elementwise()
    if elementwise is None:
        return None

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + elementwise(b, h, q_idx, kv_idx)

    return add_bias


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    softmax_scale: float,
    memo: ForwardMemo | None = None,
    failures: set[str] | None = None,
) -> torch.Tensor | None:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Tq,Hq,D), or None when FlexAttention cannot serve it.

    ``failures``: the patched model's set of failed backends; a compile failure adds ``"flex"``."""
    score_mod = _score_mod(bias)
    if score_mod is None or not flex_available():
        return None
    if q.device.type != "cuda" and torch.is_grad_enabled():
        return None  # FlexAttention has no backward off CUDA
    batch, _, q_len, _ = q.shape
    k_len = k.shape[-2]
    if mask is None:
        block_mask = _block_mask(None, batch, q_len, k_len, q.device)
    else:
        build = functools.partial(_block_mask, mask, batch, q_len, k_len, q.device)
        if memo is None or torch.compiler.is_compiling():  # id() cannot be traced; no memo there
            block_mask = build()
        else:
            block_mask = memo.get(("flex_block_mask", id(mask), q_len, k_len), build)
    compiled = q.device.type == "cuda"
    gqa = q.shape[1] != k.shape[1]
    try:
        with warnings.catch_warnings():
            # uncompiled FlexAttention warns that it is slow: off CUDA it is the tested reference path
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = _flex_function(compiled)(
                q, k, v, score_mod=score_mod, block_mask=block_mask, scale=softmax_scale, enable_gqa=gqa
            )
    except Exception as error:  # a kernel this build of torch cannot compile: say so once, fall back
        if not compiled:
            raise
        if failures is not None:
            failures.add(FlexBackend.name)
        warnings.warn(
            f"hf_posenc: FlexAttention failed ({type(error).__name__}: {error}); "
            "this model uses the chunked backend from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return out.transpose(1, 2)


@register_backend
class FlexBackend(Backend):
    name = "flex"
    priority = 50
    requests = frozenset({AUTO, "flex"})
    selectable = True

    def serves(self, call: AttentionCall) -> bool:
        return (
            call.bias is not None
            and not call.explicit
            and not call.want_weights
            and call.dropout_p == 0.0
            and (call.requested == "flex" or call.on_cuda)
        )

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return output_only(attend_flex(**call.bias_arguments(), memo=call.score.memo, failures=call.failures))
