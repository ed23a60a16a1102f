"""The FlexAttention backend for block biases.

FlexAttention (``torch.nn.attention.flex_attention``) fuses the bias into the attention
kernel: ``score_mod(score, b, h, q_idx, kv_idx)`` adds the bias of each score, which every
bias form that can say it per score gives (:meth:`BlockBias.elementwise`: a distance table,
separable terms, FIRE's pieces), and a block mask skips the future (and padding).
On CUDA the function is compiled (``torch.compile``) with kernel options from the ladder of
:mod:`.flex_kernels` (smaller tiles where torch's own choice runs out of shared memory);
elsewhere it runs uncompiled, which is exact but materialises the scores (for tests, not for
speed) and has no backward. Causal block masks are cached per (Tq, Tk, device); padding masks
per forward.

Compiled FlexAttention never serves a call of fewer than :data:`FLEX_MIN_QUERIES` queries
(decoding steps, short prompts): each such call would be a new shape to compile, and the
chunked backend computes a few query rows at once without any (T, T) tensor.

:func:`attend_flex` reports ``None`` when it cannot serve a call, and the dispatcher falls back
to the chunked backend: only for that kind of call (:class:`.flex_kernels.KernelClass`), never
for the whole model.

Registered as backend ``flex``: under ``backend="flex"``, and ``"auto"`` on CUDA.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from ..compat import raise_recompile_limit
from ..core.memo import ForwardMemo
from ..encodings.block_bias import BlockBias
from .backend import AUTO, AttentionCall, Backend, output_only, register_backend
from .flex_kernels import attend_with_ladder

#: the fewest queries a compiled FlexAttention call serves (one mask block); fewer go to chunked
FLEX_MIN_QUERIES = 128
#: compile FlexAttention off CUDA too (tests of the compiled forward on CPU; slow there)
COMPILE_OFF_CUDA = False
#: compiled graphs FlexAttention may keep: one per (bias form, length, dtype, with/without
#: backward); torch's default of 8 would send the ninth to the uncompiled O(T^2) path
FLEX_RECOMPILE_LIMIT = 256

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
        raise_recompile_limit(FLEX_RECOMPILE_LIMIT)
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


def compiles(device: torch.device) -> bool:
    """Whether FlexAttention runs compiled on ``device`` (CUDA; elsewhere only under COMPILE_OFF_CUDA)."""
    return device.type == "cuda" or COMPILE_OFF_CUDA


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: BlockBias,
    mask: torch.Tensor | None,
    softmax_scale: float,
    memo: ForwardMemo | None = None,
    kernels: dict[str, str] | None = None,
) -> torch.Tensor | None:
    """q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) -> (B,Tq,Hq,D), or None when FlexAttention cannot serve it.

    ``kernels``: the patched model's record of the kernel that served each kind of call."""
    score_mod = _score_mod(bias)
    if score_mod is None or not flex_available():
        return None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type != "cuda" and grad:
        return None  # FlexAttention has no backward off CUDA
    compiled = compiles(q.device)
    if compiled and q.shape[-2] < FLEX_MIN_QUERIES:
        return None  # decoding / short calls: never a new compiled shape per token
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
    gqa = q.shape[1] != k.shape[1]
    function = _flex_function(compiled)

    def attempt(q, k, v, kernel_options: dict[str, object] | None = None) -> torch.Tensor:
        return function(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=gqa,
            kernel_options=kernel_options or None,
        )

    if not compiled:
        with warnings.catch_warnings():
            # uncompiled FlexAttention warns that it is slow: off CUDA it is the tested reference path
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return attempt(q, k, v).transpose(1, 2)
    out = attend_with_ladder(
        attempt, q, k, v, used=kernels, form=type(bias).__name__
    )  # (B, Hq, Tq, D) or None
    return None if out is None else out.transpose(1, 2)


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
        return output_only(attend_flex(**call.bias_arguments(), memo=call.score.memo, kernels=call.kernels))
