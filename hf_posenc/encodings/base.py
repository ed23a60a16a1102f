"""The contract every encoding implements: any subset of these stages, in pipeline order.

1. ``embed``             absolute vector added to the token embeddings (sinusoidal, learned);
2. ``layer_input``       rewrite the hidden states entering the q/k(/v) projections (ExPE);
3. ``adjust_qkv``        change q, k, v right after the projections (QK-norm, token shift);
4. ``rotate``            transform q and k from their positions (the RoPE family);
5. ``logits``            compute q.k itself when no per-token transform of q and k can
                         (per-query frequencies of dynamic NTK RoPE); keys are cached raw;
6. ``score_bias``        additive term on the attention logits (T5, ALiBi, KERPLE, FoX, ...);
7. ``transform_scores``  rewrite the full score matrix (CAPE, CoPE): needs explicit scores;
8. ``normalize``         replace the softmax (stick-breaking attention);
9. ``adjust_output``     change the attention output before the output projection (gates, norms).

Score-level stages receive a :class:`ScoreContext`. Encodings that must carry state from one
decoding step to the next (cumulative forget gates, token-shift inputs) keep it in
``ScoreContext.state`` / the ``state`` argument: a dict per layer that lives as long as the
KV cache it belongs to.

A stage an encoding does not override costs nothing: the attention core skips it.
New parameters are registered on the encoding module, which the patch attaches to the
model as ``model.posenc`` so they are trained, saved, reloaded and moved with ``.to()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from ..config import FORMAT_VERSION, EncodingConfig
from ..memo import ForwardMemo
from ..models.base import ModelGeometry
from .block_bias import BlockBias

MARKER_BUFFER = "reload_with_hf_posenc_from_pretrained"
#: instance attribute holding values an encoding module keeps between forwards (not module state:
#: pure functions of its config and tensors); ``reconfigure`` drops it, so no stale value survives
CACHE_ATTRIBUTE = "_posenc_cache"
STAGES = (
    "embed",
    "layer_input",
    "adjust_qkv",
    "rotate",
    "logits",
    "score_bias",
    "transform_scores",
    "normalize",
    "adjust_output",
)


@dataclasses.dataclass
class ScoreContext:
    """What score-level stages see in one attention call."""

    layer_idx: int
    q: torch.Tensor  # (B, Hq, Tq, D) queries, after rotation
    k: torch.Tensor  # (B, Hkv, Tk, D) keys, after the cache update
    hidden: torch.Tensor  # (B, Tq, hidden) the layer's input
    q_positions: torch.Tensor  # (B, Tq) absolute positions of the queries
    memo: ForwardMemo
    state: dict[str, Any] | None = None  # this layer's decoding state; None without a KV cache
    #: which keys each query may attend to, (B|1, 1, Tq, Tk) bool (True = may attend), set by the
    #: core right before ``transform_scores`` / ``normalize``; None there means every key is allowed
    #: (one decoding query without padding). Stages that accumulate over keys (CoPE's cumulative
    #: gates) use it to keep masked keys (padding, future, outside a sliding window) out.
    allowed: torch.Tensor | None = None

    @property
    def q_len(self) -> int:
        return self.q.shape[-2]

    @property
    def k_len(self) -> int:
        return self.k.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.q.device


def probe_context(
    geometry: ModelGeometry, q_len: int, k_len: int | None = None, layer_idx: int = 0
) -> ScoreContext:
    """A context with zero q/k/hidden and positions ``k_len - q_len ..``: inspect a positional bias."""
    k_len = q_len if k_len is None else k_len
    d = geometry.head_dim
    return ScoreContext(
        layer_idx=layer_idx,
        q=torch.zeros(1, geometry.num_heads, q_len, d),
        k=torch.zeros(1, geometry.num_kv_heads, k_len, d),
        hidden=torch.zeros(1, q_len, geometry.hidden_size),
        q_positions=torch.arange(k_len - q_len, k_len)[None],
        memo=ForwardMemo(),
    )


class Encoding(nn.Module):
    """Base class. Subclasses set the class attributes and override the stages they use."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    config_class: ClassVar[type[EncodingConfig]] = EncodingConfig
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: True when the encoding keeps state between decoding steps (see ``ScoreContext.state``)
    stateful: ClassVar[bool] = False
    #: True when ``rotate`` takes the keyword ``coordinates``: the (B|1,T,axes) N-D positions a caller
    #: passed to the model as ``position_coordinates`` (None when not passed); see rope2d
    takes_coordinates: ClassVar[bool] = False
    #: True when values flow from one layer to the next through ``memo.carry`` (TAPE's positional
    #: stream): reentrant gradient checkpointing cannot differentiate through that, so it is refused
    carries_layer_stream: ClassVar[bool] = False
    #: for stateful encodings: per decoding-state key, the dim aligned with the cached tokens
    #: (cropped with the cache by assisted decoding), or None when the entry cannot be rolled back
    state_sequence_dims: ClassVar[dict[str, int | None]] = {}

    def __init__(self, config: EncodingConfig, geometry: ModelGeometry) -> None:
        super().__init__()
        self.config = config
        self.geometry = geometry
        # A plain transformers load of a saved patched model reports this key as unexpected,
        # so dropping the patch is never silent, even for encodings without parameters.
        self.register_buffer(MARKER_BUFFER, torch.tensor(FORMAT_VERSION), persistent=True)

    def initialise_from_model(self, model: nn.Module, adapter) -> None:
        """Run once when patching a model (not when reloading one): e.g. copy a native table."""

    @torch.no_grad()
    def reset_parameters(self, keep_loaded: bool = False) -> list[str]:
        """Give tensors their designed initial value (what ``__init__`` sets): used by
        transformers' ``init_weights()``, e.g. after building on the meta device and ``to_empty()``.

        ``keep_loaded``: leave tensors that transformers marked as loaded from a checkpoint
        (``_is_hf_initialized``) as they are. Returns the names of the tensors reset."""
        with torch.device("cpu"):
            fresh = type(self)(self.config, self.geometry)
        expected = dict(fresh.named_parameters())
        expected.update(fresh.named_buffers())
        reset = []
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if keep_loaded and getattr(tensor, "_is_hf_initialized", False):
                continue
            tensor.copy_(expected[name])
            reset.append(name)
        return reset

    # -- which stages are implemented -----------------------------------------------
    @classmethod
    def stages(cls) -> list[str]:
        """Stages this class overrides, in pipeline order."""
        return [s for s in STAGES if getattr(cls, s) is not getattr(Encoding, s)]

    def active_stages(self) -> list[str]:
        """Stages this instance runs; an encoding whose parameters switch paths overrides it."""
        return self.stages()

    # -- stages ---------------------------------------------------------------------
    def embed(self, positions: torch.Tensor, memo: ForwardMemo) -> torch.Tensor:
        """positions (B,T) int64 -> additive embedding (B,T,hidden) in fp32."""
        raise NotImplementedError

    def layer_input(
        self, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor, memo: ForwardMemo
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B,T,hidden) -> (input of the q/k projections, input of the v projection)."""
        raise NotImplementedError

    def rotate(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        q_positions: torch.Tensor,
        k_positions: torch.Tensor,
        memo: ForwardMemo,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B,Hq,Tq,D), k (B,Hkv,Tk,D) with positions (B,Tq), (B,Tk) -> rotated q, k.

        Encodings with ``takes_coordinates = True`` also receive ``coordinates=`` (B|1,T,axes) or None."""
        raise NotImplementedError

    def logits(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        q_positions: torch.Tensor,
        k_positions: torch.Tensor,
        memo: ForwardMemo,
    ) -> torch.Tensor:
        """Raw (unscaled) q.k logits (B,Hq,Tq,Tk) fp32 from un-rotated q (B,Hq,Tq,D), k (B,Hkv,Tk,D)."""
        raise NotImplementedError

    def adjust_qkv(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        state: dict[str, Any] | None,
        memo: ForwardMemo,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k, v (B,Hkv,T,D) fresh from the projections -> adjusted q, k, v.

        ``hidden`` (B,T,hidden) is the layer input, ``positions`` (B,T) the tokens' positions."""
        raise NotImplementedError

    def score_bias(self, ctx: ScoreContext) -> torch.Tensor:
        """Additive logit bias, fp32, broadcastable to (B, Hq, Tq, Tk) — usually (Hq, Tq, Tk).

        Queries and keys are indexed bottom-right aligned (query ``i`` sits at key index
        ``Tk - Tq + i``), so a bias of ``i - j`` is the distance in tokens. Left padding
        shifts both sides equally, so relative biases are padding-invariant.
        """
        raise NotImplementedError

    def block_bias(self, ctx: ScoreContext) -> BlockBias:
        """The ``score_bias`` of this call as O(T) values (see :class:`BlockBias`).

        Optional: an encoding that implements it runs on the chunked and FlexAttention
        backends, which never write out the (B, Hq, Tq, Tk) bias. Called instead of (never
        besides) ``score_bias``, so it has the same side effects (decoding state, projections).
        """
        raise NotImplementedError

    def fused_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor | None:
        """Optional: the whole attention of this call from a fused kernel -> (B, Tq, Hq, D), or
        None when no kernel serves it (then the stages run). Asked first by ``backend="auto"``
        on CUDA; q (B,Hq,Tq,D), k/v (B,Hkv,Tk,D) after rotation and the cache update."""
        return None

    def rows_independent(self) -> bool:
        """True when ``transform_scores`` / ``normalize`` treat each query's row of scores on its
        own (given the keys it may attend): the explicit path may then run one block of queries
        at a time, each with its causal keys. Encodings that say so are tested for it."""
        return False

    @classmethod
    def has_block_bias(cls) -> bool:
        """Whether this class implements :meth:`block_bias`."""
        return cls.block_bias is not Encoding.block_bias

    def transform_scores(self, ctx: ScoreContext, scores: torch.Tensor) -> torch.Tensor:
        """Scaled logits plus bias (B, Hq, Tq, Tk) fp32 -> new scores (masking comes after).

        ``ctx.allowed`` holds the mask that will be applied afterwards (None: every key allowed).
        """
        raise NotImplementedError

    def normalize(self, ctx: ScoreContext, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """scores (B,Hq,Tq,Tk) fp32 and ``allowed`` (B|1,1,Tq,Tk) bool -> attention weights."""
        raise NotImplementedError

    def adjust_output(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        out: torch.Tensor,
        state: dict[str, Any] | None,
        memo: ForwardMemo,
    ) -> torch.Tensor:
        """Attention output (B, T, Hq*D) before the output projection -> adjusted output."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.to_dict().items())


def module_cache(module: nn.Module) -> dict[Any, Any]:
    """The dict of values ``module`` keeps between forwards (see :data:`CACHE_ATTRIBUTE`)."""
    return module.__dict__.setdefault(CACHE_ATTRIBUTE, {})


def clear_module_caches(root: nn.Module) -> None:
    """Drop what :func:`module_cache` holds on ``root`` and every submodule."""
    for module in root.modules():
        module.__dict__.pop(CACHE_ATTRIBUTE, None)


def query_key_distance(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) int64 matrix of ``i - j`` in key-index space, bottom-right aligned."""
    q_index = torch.arange(k_len - q_len, k_len, device=device)
    k_index = torch.arange(k_len, device=device)
    return q_index[:, None] - k_index[None, :]
