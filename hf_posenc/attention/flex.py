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

Compiled calls run at a length bucket (:func:`bucket_length`), not at their own lengths: q, k and
v are padded to the bucket, the block mask masks the padded keys and discards the padded queries
(whole padded blocks are skipped by the kernel), the bias is evaluated on the padded ranges
(:class:`~hf_posenc.encodings.score_grid.ScoreGrid`: tables padded, the key offset a tensor) and
the output is sliced back. One graph is compiled per (bias form, bucket of Tq, bucket of Tk,
dtype, with or without backward) instead of per length: a bucket is a multiple of
``step = max(128, 2^(ceil(log2 n) - 1) / FLEX_BUCKETS_PER_OCTAVE)`` (``FLEX_BUCKETS_PER_OCTAVE``
buckets between each power of two and the next), so it pads a length n by less than
``max(128, n / FLEX_BUCKETS_PER_OCTAVE)`` positions (< 25 % past 1024 with 4 per octave; 8000 and
8192 share the bucket 8192). Within a bucket the work is that of the call's own lengths up to
one partial 128-block: whole padded blocks are empty in the block mask and skipped.

``FLEX_DYNAMIC = True`` (experimental, off) compiles with dynamic shapes instead
(``torch.compile(dynamic=True)``, no padding): one graph for every length, exact on CPU for
causal calls; with a padding mask torch 2.13's CPU template does not build ("CppCompileError:
'cur_qSplitSize7' was not declared") and that kind of call goes to chunked; its GPU kernels are
not measured (``scripts/gpu_flex_buckets.py --mode dynamic``), so buckets are the default.

Compiled FlexAttention never serves a call of fewer than :data:`FLEX_MIN_QUERIES` queries
(decoding steps, short prompts): each such call would be a new shape to compile, and the
chunked backend computes a few query rows at once without any (T, T) tensor.

:func:`attend_flex` reports ``None`` when it cannot serve a call, and the dispatcher falls back
to the chunked backend: only for that kind of call (:class:`.flex_kernels.KernelClass`), never
for the whole model.

Registered as backend ``flex``: under ``backend="flex"``, and ``"auto"`` on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..compat import raise_recompile_limit
from ..core.memo import ForwardMemo
from ..encodings.block_bias import BlockBias
from ..encodings.score_grid import ScoreGrid
from .backend import AUTO, AttentionCall, Backend, output_only, register_backend
from .flex_kernels import attend_with_ladder, kernel_class

#: the fewest queries a compiled FlexAttention call serves (one mask block); fewer go to chunked
FLEX_MIN_QUERIES = 128
#: compile FlexAttention off CUDA too (tests of the compiled forward on CPU; slow there)
COMPILE_OFF_CUDA = False
#: compiled graphs FlexAttention may keep: one per (bias form, length bucket, dtype, with/without
#: backward); torch's default of 8 would send the ninth to the uncompiled O(T^2) path
FLEX_RECOMPILE_LIMIT = 256
#: length buckets of compiled calls between each power of two and the next (padding < n / this);
#: 0: no buckets, every length compiled at its own shape
FLEX_BUCKETS_PER_OCTAVE = 4
#: compile with dynamic shapes (one graph for every length, no buckets) instead of length buckets;
#: experimental: padding masks do not build on CPU (see the module's docstring)
FLEX_DYNAMIC = False
#: the smallest bucket step: FlexAttention's mask block (a bucket never splits a block)
FLEX_BUCKET_STEP = 128

_BLOCK_MASKS: dict[tuple, object] = {}
_BLOCK_MASK_LIMIT = 16


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _flex_function(compiled: bool, dynamic: bool = False) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        raise_recompile_limit(FLEX_RECOMPILE_LIMIT)
        return torch.compile(flex_attention, dynamic=dynamic)
    return flex_attention


def bucket_length(n: int) -> int:
    """The length a compiled call of ``n`` queries (or keys) runs at: ``n`` rounded up to a multiple
    of ``max(FLEX_BUCKET_STEP, 2^(ceil(log2 n) - 1) / FLEX_BUCKETS_PER_OCTAVE)``, so
    ``n <= bucket_length(n) < n + max(FLEX_BUCKET_STEP, n / FLEX_BUCKETS_PER_OCTAVE)``."""
    if FLEX_BUCKETS_PER_OCTAVE <= 0 or FLEX_DYNAMIC:
        return n
    below = 1 << max(n - 1, 1).bit_length() - 1  # the largest power of two < n (n > 1)
    step = max(FLEX_BUCKET_STEP, below // FLEX_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A call's lengths and the sizes it runs at; when ``bucketed`` (compiled calls) also its key
    offset and key count as 0-d int32 tensors: values the compiled graph reads, not constants it
    would be specialised on (one graph per bucket, whatever the offset)."""

    q_len: int
    k_len: int
    bucketed: bool
    q_size: int
    k_size: int
    offset: torch.Tensor | None = None  # () int32: k_len - q_len
    keys: torch.Tensor | None = None  # () int32: k_len

    def grid(self) -> ScoreGrid | None:
        return None if self.offset is None else ScoreGrid(self.q_size, self.k_size, self.offset)


def _layout(q_len: int, k_len: int, device: torch.device, bucketed: bool, cached: bool = True) -> _Layout:
    """The call's layout; compiled (``bucketed``) at its length buckets."""
    if not bucketed:
        return _Layout(q_len, k_len, False, q_len, k_len)
    sizes = (q_len, k_len, bucket_length(q_len), bucket_length(k_len))  # buckets: as set now
    return (_bucketed_layout if cached else _bucketed_layout.__wrapped__)(*sizes, device)


@functools.lru_cache(maxsize=64)
def _bucketed_layout(q_len: int, k_len: int, q_size: int, k_size: int, device: torch.device) -> _Layout:
    # filled on the device (no host-to-device copy per call), once per (Tq, Tk, Tq', Tk', device);
    # never inference tensors (kept for later calls, which may be a training step's: FlexAttention
    # saves its captured tensors and block mask for backward)
    with torch.inference_mode(False):
        offset = torch.full((), k_len - q_len, dtype=torch.int32, device=device)
        keys = torch.full((), k_len, dtype=torch.int32, device=device)
    return _Layout(q_len, k_len, True, q_size, k_size, offset, keys)


def _causal_block_mask(layout: _Layout, device: torch.device):
    """The causal block mask of one (Tq, Tk, device), padded queries and keys masked (cached)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (layout.q_len, layout.k_len, layout.q_size, layout.k_size, layout.bucketed, str(device))
    cached = None if torch.compiler.is_compiling() else _BLOCK_MASKS.get(key)
    if cached is None:
        if len(_BLOCK_MASKS) >= _BLOCK_MASK_LIMIT:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        offset, keys = layout.offset, layout.keys
        if offset is not None:

            def causal(b, h, q_idx, kv_idx):  # a padded query (key index >= Tk) attends nothing
                return (q_idx + offset >= kv_idx) & (q_idx + offset < keys)
        else:
            constant = layout.k_len - layout.q_len

            def causal(b, h, q_idx, kv_idx):
                return q_idx + constant >= kv_idx

        with torch.inference_mode(False):  # kept for later calls (see _bucketed_layout)
            cached = create_block_mask(causal, None, None, layout.q_size, layout.k_size, device=device)
        if not torch.compiler.is_compiling():
            _BLOCK_MASKS[key] = cached
    return cached


def _padding_block_mask(mask: torch.Tensor, batch: int, layout: _Layout, device: torch.device):
    """The block mask of a boolean (B|1, 1, Tq, Tk) mask, causal already; padded queries and keys
    masked."""
    from torch.nn.attention.flex_attention import create_block_mask

    extra_q, extra_k = layout.q_size - layout.q_len, layout.k_size - layout.k_len
    allowed = F.pad(mask, (0, extra_k, 0, extra_q), value=False) if extra_q or extra_k else mask
    allowed = allowed.expand(batch, 1, layout.q_size, layout.k_size)  # (B, 1, Tq', Tk') bool

    def padded(b, h, q_idx, kv_idx):
        return allowed[b, 0, q_idx, kv_idx]

    return create_block_mask(padded, batch, None, layout.q_size, layout.k_size, device=device)


def _pad_length(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, H, T, D) zero-padded to (B, H, size, D), contiguous either way.

    Contiguous also when T == size (no padding): q, k and v usually arrive as transposed views of
    (B, T, H, D), and the compiled kernel is specialised on strides as well as sizes, so a call at
    a bucket's own length would otherwise compile a second graph beside the padded calls' one
    (seen on an H100 and on CPU: T=8192 after T=8000)."""
    extra = size - x.shape[-2]
    return x.contiguous() if extra == 0 else F.pad(x, (0, 0, 0, extra))


def _score_mod(bias: BlockBias, grid: ScoreGrid | None = None) -> Callable | None:
    """``score + bias`` per score (over ``grid``'s padded ranges when given), or None when the
    bias form cannot say it per score."""
    elementwise = bias.elementwise(grid)
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
    if not flex_available():
        return None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type != "cuda" and grad:
        return None  # FlexAttention has no backward off CUDA
    compiled = compiles(q.device)
    if compiled and q.shape[-2] < FLEX_MIN_QUERIES:
        return None  # decoding / short calls: never a new compiled shape per token
    batch, _, q_len, _ = q.shape
    k_len = k.shape[-2]
    tracing = torch.compiler.is_compiling()  # inside a compiled model: nothing traced is cached
    layout = _layout(q_len, k_len, q.device, compiled, cached=not tracing)
    score_mod = _score_mod(bias, layout.grid())
    if score_mod is None:
        return None
    if mask is None:
        block_mask = _causal_block_mask(layout, q.device)
    else:
        build = functools.partial(_padding_block_mask, mask, batch, layout, q.device)
        if memo is None or tracing:  # id() cannot be traced; no memo there
            block_mask = build()
        else:
            block_mask = memo.get(
                ("flex_block_mask", id(mask), q_len, k_len, layout.q_size, layout.k_size), build
            )
    q = _pad_length(q, layout.q_size)  # (B, Hq, Tq', D)
    k, v = _pad_length(k, layout.k_size), _pad_length(v, layout.k_size)  # (B, Hkv, Tk', D)
    gqa = q.shape[1] != k.shape[1]
    function = (
        _flex_function(compiled, dynamic=True) if compiled and FLEX_DYNAMIC else _flex_function(compiled)
    )

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
        if kernels is not None:  # bench.json / patch_info say what ran: not a compiled kernel
            kernels.setdefault(kernel_class(q, k, v, type(bias).__name__).label(), "flex (uncompiled)")
        with warnings.catch_warnings():
            # uncompiled FlexAttention warns that it is slow: off CUDA it is the tested reference path
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return attempt(q, k, v).transpose(1, 2)
    out = attend_with_ladder(
        attempt, q, k, v, used=kernels, form=type(bias).__name__
    )  # (B, Hq, Tq', D) or None
    return None if out is None else out[:, :, :q_len].transpose(1, 2)


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
