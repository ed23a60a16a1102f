"""Attention backends: registered objects, and the one dispatcher that picks among them.

A backend says which calls it can serve (:meth:`Backend.serves`: the ``backend=`` choices it
answers to, and what it needs of the call: device, dtype, bias form, mask, gradients) and at
what priority; :func:`dispatch` asks them from the highest priority down and takes the first
answer. A backend may still decline in :meth:`Backend.attend` (returns None, e.g. a kernel that
failed to compile), and the next one serves. ``eager`` serves every call, so one always does.

Adding a backend is one file: subclass :class:`Backend` and decorate it with
:func:`register_backend`; importing the package imports every module in it
(``attention/__init__.py``), so nothing else changes.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..core.recompute import chains, recomputed
from ..encodings.base import Encoding
from ..encodings.block_bias import BlockBias
from ..encodings.call import ScoreCall
from . import stream_flash

#: the choice that lets every backend serve what it can
AUTO = "auto"
#: stages that need the explicit (B, Hq, Tq, Tk) scores
EXPLICIT_STAGES = frozenset({"logits", "transform_scores", "normalize"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One attention call of one layer, as every backend receives it."""

    #: what the encoding's score stages receive; its ``q`` (B, Hq, Tq, D) after rotation and
    #: ``k`` (B, Hkv, Tk, D) after the cache update are the call's queries and keys
    score: ScoreCall
    v: torch.Tensor  # (B, Hkv, Tk, D)
    mask: torch.Tensor | None  # (B|1, 1, Tq, Tk) bool, True = may attend; None: causal
    softmax_scale: float
    dropout_p: float
    #: the ``backend=`` the model was patched with
    requested: str
    #: output_attentions: the caller wants the (B, Hq, Tq, Tk) weights
    want_weights: bool
    encoding: Encoding
    stages: frozenset[str]
    #: the encoding's score bias of this call (computed once, before dispatch), or None
    bias: BlockBias | None
    #: backends that failed on this model and are not asked again (per patched model)
    failures: set[str]
    #: what served each kind of call on this model, e.g. ``{"cuda:0/bfloat16/d64/forward": "flex
    #: (default)"}`` (per patched model; ``patch_info(model)["kernels"]``)
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def explicit(self) -> bool:
        """Whether a stage needs the explicit scores (logits, transform_scores, normalize)."""
        return bool(self.stages & EXPLICIT_STAGES)

    @property
    def q(self) -> torch.Tensor:
        return self.score.q

    @property
    def k(self) -> torch.Tensor:
        return self.score.k

    @property
    def on_cuda(self) -> bool:
        return self.q.device.type == "cuda"

    def bias_arguments(self) -> dict[str, Any]:
        """q, k, v and the keywords every bias backend's function takes (``bias``, ``mask``, ``softmax_scale``)."""
        return {
            "q": self.q,
            "k": self.k,
            "v": self.v,
            "bias": self.bias,
            "mask": self.mask,
            "softmax_scale": self.softmax_scale,
        }


class Backend:
    """One way to compute attention. Subclasses set the class attributes and override both methods."""

    name: ClassVar[str] = ""
    #: higher is asked first
    priority: ClassVar[int] = 0
    #: the ``backend=`` choices under which it may serve
    requests: ClassVar[frozenset[str]] = frozenset()
    #: whether ``name`` is itself a ``backend=`` choice
    selectable: ClassVar[bool] = False

    def serves(self, call: AttentionCall) -> bool:
        """Whether this backend can compute ``call`` (its choice is already checked)."""
        raise NotImplementedError

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """-> (output (B, Tq, Hq, D), weights (B, Hq, Tq, Tk) or None), or None to let the next one serve."""
        raise NotImplementedError

    def keeps_chained_inputs(self, call: AttentionCall) -> bool:
        """Whether :meth:`attend` runs ``call`` through a :func:`~hf_posenc.core.recompute.kernel`
        with its own backward, which keeps a q, k or v made by an encoding's recomputed step as
        that step's inputs (rebuilt before the kernel's backward): then the call needs no
        recomputation of its own (:func:`dispatch_chained`)."""
        return False


def output_only(out: torch.Tensor | None) -> tuple[torch.Tensor, None] | None:
    """A kernel's output (B, Tq, Hq, D) without weights, or None when the kernel declined."""
    return None if out is None else (out, None)


_REGISTRY: dict[str, Backend] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: add one instance of ``cls`` to the registry under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY or cls.name == AUTO:
        raise ValueError(f"backend name {cls.name!r} is empty, taken or reserved")
    _REGISTRY[cls.name] = cls()
    return cls


def registered_backends() -> list[Backend]:
    """Every registered backend, the highest priority first."""
    return sorted(_REGISTRY.values(), key=lambda backend: -backend.priority)


def backend_choices() -> tuple[str, ...]:
    """The values ``backend=`` accepts: ``auto`` and every selectable backend's name."""
    return (AUTO, *(backend.name for backend in registered_backends() if backend.selectable))


def candidates(call: AttentionCall) -> list[Backend]:
    """The backends that would serve ``call``, in the order :func:`dispatch` asks them."""
    return [
        backend
        for backend in registered_backends()
        if call.requested in backend.requests and backend.name not in call.failures and backend.serves(call)
    ]


def dispatch(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(output (B, Tq, Hq, D), weights or None) from the first backend that serves ``call``."""
    for backend in candidates(call):
        result = backend.attend(call)
        if result is not None:
            return result
    raise RuntimeError(f"no attention backend served this call (backend={call.requested!r})")


def dispatch_with_stream(
    call: AttentionCall, stream: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call's attention applied to its values and to ``stream`` (B, Hkv, Tk, S) with the same
    weights: (output (B, Tq, Hq*Dv + Hq*S), weights or None) — an ``attends_stream`` encoding
    (TAPE). Per token the output holds every head's attended values, then every head's attended
    stream, so each half is a view of it.

    Without a bias or explicit-score stage it is one call of the fused kernels: the values are
    ``(v, stream)`` and q, k are zero-padded to the same width, so every score is the same sum
    (the added products are exact zeros) and the kernel, which wants equal widths, stays fused
    (values wider than q/k would send SDPA to its O(T^2) math path). Otherwise, two calls with
    the same queries and keys (their weights are the same function of them).

    On CPU (fp32/fp64, no dropout, no weights asked for) the call is attention in explicit blocks
    of query rows with the score products at q's width and FlashAttention-2's backward from the
    forward's log-sum-exp (:mod:`.stream_flash`, :mod:`.wide_values`): one forward and one
    backward, keeping q, k, v, the stream, the output (the views the layer keeps anyway) and the
    log-sum-exp. Elsewhere (GPUs,
    bf16) with gradients the fused call keeps only q, k, v and the stream and runs again in backward
    (:func:`~hf_posenc.core.recompute.recomputed`): kept as is, the kernel would hold its padded
    q and k, the widened values and its output, all (Dv + S) wide, twice what plain attention
    keeps per token. The price there is one more forward of the attention per training step.
    """
    if not stream.shape[-1]:  # nothing to attend beside the values: the model's own attention
        # Not dispatch_chained, though TAPE's rotated q and k come from a recomputed step: it would
        # run this attention's forward again in backward to keep the raw q, k instead of the rotated
        # ones. The bench's TAPE (T=2048, vocab 256) trained at 1.25x-1.29x native that way against
        # 1.22x-1.25x plain (two trees alternating, 5 rounds each, 2026-11-28 12:04 UTC), for a
        # peak of 170 against 174 MiB by the profiler's count (native 157; 177 when this layer
        # took the blocked stream path).
        out, weights = dispatch(call)  # (B, Tq, Hq, Dv)
        return out.flatten(2), weights
    v = call.v
    stream = stream.to(v.dtype)
    dv = v.shape[-1]
    if call.bias is None and not call.explicit:
        if stream_flash.serves(call):
            return stream_flash.attend_with_stream(call, stream), None
        extra = v.shape[-1] + stream.shape[-1] - call.q.shape[-1]  # q/k width -> value width
        bare = _without_qkv(call)  # kept by backward's closure: not the (rotated) q, k, v themselves

        def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: torch.Tensor):
            score = dataclasses.replace(bare.score, q=F.pad(q, (0, extra)), k=F.pad(k, (0, extra)))
            out, weights = dispatch(dataclasses.replace(bare, score=score, v=torch.cat((v, stream), dim=-1)))
            return _heads_then_stream(out[..., :dv], out[..., dv:]), weights

        if call.dropout_p == 0.0 and not call.want_weights:  # (B, Tq, Hq*Dv + Hq*S), no weights
            return recomputed(lambda *inputs: fused(*inputs)[0], call.q, call.k, v, stream), None
        return fused(call.q, call.k, v, stream)
    out, weights = dispatch(call)  # (B, Tq, Hq, Dv)
    attended, _ = dispatch(dataclasses.replace(call, v=stream, want_weights=False))  # (B, Tq, Hq, S)
    return _heads_then_stream(out, attended), weights


def _heads_then_stream(out: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Hq, Dv), (B, Tq, Hq, S) -> (B, Tq, Hq*Dv + Hq*S)."""
    return torch.cat((out.flatten(2), attended.flatten(2)), dim=-1)


def dispatch_chained(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The call's attention recomputed in backward, when its q, k or v is the output of an
    encoding's recomputed step (FoX (Pro)'s token shift and QK-norm): then what is kept for
    backward is that step's input (the raw q, k, v) and the bias's tensors, not the step's
    output beside it, nor the kernel's output and statistics. The price is one more forward of
    the attention per training step. None (dispatch as usual) without gradients, with dropout,
    explicit scores or weights asked for, when no input chains, or when the backend that serves
    the call keeps chained inputs itself (:meth:`Backend.keeps_chained_inputs`: FoX Pro's
    separable bias in training on CPU, whose fused kernel pair then runs once forward and once
    backward).
    """
    if not torch.is_grad_enabled() or call.dropout_p != 0.0 or call.want_weights or call.explicit:
        return None
    if not any(chains(t) for t in (call.q, call.k, call.v)):
        return None
    first = next(iter(candidates(call)), None)
    if first is not None and first.keeps_chained_inputs(call):  # its kernel rebuilds them itself
        return None
    bias = call.bias
    # the bias's tensor fields are inputs, so their gradients flow; rebuilt on a copy of the form
    fields = {} if bias is None else {n: t for n, t in vars(bias).items() if isinstance(t, torch.Tensor)}
    bare = _without_qkv(call)  # kept by backward's closure: not the shifted / normalised q, k, v

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        rebuilt = bias
        if bias is not None:
            rebuilt = copy.copy(bias)
            for name, value in zip(fields, values, strict=True):
                object.__setattr__(rebuilt, name, value)  # a frozen dataclass
        score = dataclasses.replace(bare.score, q=q, k=k)
        return dispatch(dataclasses.replace(bare, score=score, v=v, bias=rebuilt))[0]

    return recomputed(attend, call.q, call.k, call.v, *fields.values()), None


def _without_qkv(call: AttentionCall) -> AttentionCall:
    """``call`` with empty q, k and v: what a recomputed attention's closure keeps until backward
    (which passes its own q, k, v). Holding the call itself would keep its q, k and v alive
    until backward, beside the inputs they are rebuilt from (one (B, H, T, D) tensor per
    layer each: the rotated or normalised copies that recomputation exists to drop)."""
    empty = call.q.new_empty(0)
    return dataclasses.replace(call, score=dataclasses.replace(call.score, q=empty, k=empty), v=empty)
