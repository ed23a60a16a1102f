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

Every stage receives one immutable call object (:mod:`~hf_posenc.encodings.call`):
``embed`` a :class:`ForwardCall`, the layer stages a :class:`LayerCall`, the score stages a
:class:`ScoreCall`. Encodings that must carry state from one decoding step to the next
(cumulative forget gates, token-shift inputs) keep it in ``call.state``: a dict per layer
that lives as long as the KV cache it belongs to. Score biases are written once, as a
:class:`BlockBias` form that every attention backend reads.

A stage an encoding does not override costs nothing: the attention core skips it.
New parameters are registered on the encoding module, which the patch attaches to the
model as ``model.posenc`` so they are trained, saved, reloaded and moved with ``.to()``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from ..core.config import FORMAT_VERSION, EncodingConfig, PositionLimit
from ..core.interpolation import ScaledRange
from ..core.layout import query_key_indices
from ..core.memo import ForwardMemo
from ..models.base import ModelGeometry
from .block_bias import BlockBias
from .call import ForwardCall, LayerCall, NeighbourSplit, ScoreCall
from .saturating_transform import BandForm

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


def probe_call(
    geometry: ModelGeometry, q_len: int, k_len: int | None = None, layer_idx: int = 0
) -> ScoreCall:
    """A call with zero q/k/hidden and positions ``k_len - q_len ..``: inspect a positional bias."""
    k_len = q_len if k_len is None else k_len
    d = geometry.head_dim
    return ScoreCall(
        layer_idx=layer_idx,
        q=torch.zeros(1, geometry.num_heads, q_len, d),
        k=torch.zeros(1, geometry.num_kv_heads, k_len, d),
        hidden=torch.zeros(1, q_len, geometry.hidden_size),
        positions=query_key_indices(q_len, k_len, None)[0][None],  # (1, Tq) bottom-right aligned
        memo=ForwardMemo(),
    )


def probe_layer_call(
    positions: torch.Tensor, layer_idx: int = 0, coordinates: torch.Tensor | None = None
) -> LayerCall:
    """A layer call for tokens at ``positions`` (B, T) with an empty layer input: inspect a rotation."""
    return LayerCall(
        positions=positions,
        memo=ForwardMemo(),
        coordinates=coordinates,
        layer_idx=layer_idx,
        hidden=torch.zeros(*positions.shape, 0),
    )


ConfigT = TypeVar("ConfigT", bound=EncodingConfig)


def fit_single_values(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load-state-dict pre-hook of every encoding: a stored tensor of one value loads into a
    parameter of one value whatever the two shapes (a 0-dim tensor into a (1,) parameter).

    Learned scalars are (1,) parameters since FSDP2's ``fully_shard`` refuses 0-dim ones and
    DeepSpeed's broadcast views each parameter as bytes; checkpoints saved before (FIRE's ``c`` and
    ``L_multiplier`` were 0-dim) keep loading, here rather than in one loader, so that
    ``hf_posenc.from_pretrained`` and any ``load_state_dict`` (a Trainer resume's too) take them.
    Any other shape mismatch is left to torch's own error."""
    for name, param in module.named_parameters():
        key = prefix + name
        stored = state_dict.get(key)
        if (
            isinstance(stored, torch.Tensor)
            and stored.shape != param.shape
            and stored.numel() == 1
            and param.numel() == 1
        ):
            state_dict[key] = stored.reshape(param.shape)


class Encoding(nn.Module, Generic[ConfigT]):
    """Base class, generic in its config class. Subclasses set the class attributes and override
    the stages they use."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    config_class: ClassVar[type[EncodingConfig]] = EncodingConfig
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: True when the attention depends on the position ids a caller passes (rotations, absolute
    #: embeddings, position-indexed tables); False when it reads only token order, key-index
    #: distances or content (score biases over index distances, forget gates, contextual
    #: positions, no positions at all): position sampling (PoSE, randomized) is refused there
    reads_positions: ClassVar[bool] = True
    #: True when the encoding keeps state between decoding steps (see ``LayerCall.state``)
    stateful: ClassVar[bool] = False
    #: True when the encoding keeps work it may reuse in its decoding state (``LayerCall.state``,
    #: entries aligned with the cached keys by ``state_sequence_dims``) without needing it: given
    #: in uncompiled decoding over a dynamic KV cache only, and a step that finds it missing or
    #: stale recomputes it (SelfExtend's far-rotated keys). Compiled and static-cache decoding
    #: stay as for a stateless encoding.
    reuses_decoding_work: ClassVar[bool] = False
    #: True when ``rotate`` reads ``call.coordinates``: the (B|1,T,axes) N-D positions a caller
    #: passed to the model as ``position_coordinates`` (None when not passed); see rope2d
    takes_coordinates: ClassVar[bool] = False
    #: True when values flow from one layer to the next through ``memo.carry`` (TAPE's positional
    #: stream): reentrant gradient checkpointing cannot differentiate through that, so it is refused
    carries_layer_stream: ClassVar[bool] = False
    #: True when the encoding attends a second set of values with the same attention weights
    #: (TAPE's positional stream), given by :meth:`attended_stream`: the values keep the model's
    #: head width (the KV cache's value head is the model's, and the fused kernels stay usable),
    #: and the attention output handed to ``adjust_output`` is (B, Tq, Hq*D + Hq*S): per token every
    #: head's attended values, then every head's attended stream (S wide)
    attends_stream: ClassVar[bool] = False
    #: True when a score stage (``score_bias``, ``logits``, ``transform_scores``, ``normalize``) reads
    #: ``call.hidden``, the layer input of the queries (FoX's forget gates): head-parallel attention
    #: then gathers it over the ranks (:mod:`hf_posenc.attention.head_parallel`)
    scores_read_hidden: ClassVar[bool] = False
    #: for stateful encodings: per decoding-state key, the dim aligned with the cached tokens
    #: (cropped with the cache by assisted decoding), or None when the entry cannot be rolled back
    state_sequence_dims: ClassVar[dict[str, int | None]] = {}

    def __init__(self, config: ConfigT, geometry: ModelGeometry) -> None:
        super().__init__()
        self.config: ConfigT = config
        self.geometry = geometry
        # A plain transformers load of a saved patched model reports this key as unexpected,
        # so dropping the patch is never silent, even for encodings without parameters.
        self.register_buffer(MARKER_BUFFER, torch.tensor(FORMAT_VERSION), persistent=True)
        self.register_load_state_dict_pre_hook(fit_single_values)

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
        expected: dict[str, torch.Tensor] = dict(fresh.named_parameters())
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

    def position_limit(self) -> PositionLimit | None:
        """The longest input this encoding takes (``EncodingConfig.position_limit``), or None."""
        return self.config.position_limit(self.geometry)

    @classmethod
    def compiled_decoding_refusal(cls) -> str | None:
        """Why a compiled decoding step over a static KV cache (``torch.compile``, transformers'
        compiled ``generate()``) cannot run this encoding, or None when it can: decoding state kept
        beside the cache grows by the new tokens at every step, so each step has new shapes (a
        recompilation per token) and, under CUDA graphs, reads tensors the next replay overwrites."""
        if cls.stateful:
            return (
                f"{cls.name}: a compiled decoding step over a static KV cache is not supported (its decoding "
                "state beside the cache grows with every token); allowed: generate() without compile_config "
                "(it decodes eagerly, exactly), or an uncompiled forward"
            )
        return None

    @classmethod
    def mixing_refusal(cls) -> str | None:
        """Why this encoding cannot run in some layers only (a per-layer hybrid), or None when it
        can: one acting on the token embeddings acts before any layer, and one passing a stream from
        layer to layer cannot skip layers."""
        if "embed" in cls.stages():
            return (
                "it adds positions to the token embeddings, before any layer, so it cannot be given to some "
                "layers only; allowed: encodings that act inside attention (e.g. rope, nope, alibi, t5, fox)"
            )
        if cls.carries_layer_stream:
            return (
                "it passes a positional stream from each layer to the next, so it cannot skip layers; allowed: "
                "encodings whose layers are independent (e.g. rope, nope, alibi, t5, fox)"
            )
        return None

    @classmethod
    def mixable(cls) -> bool:
        """Whether this encoding may run in some layers only (see :meth:`mixing_refusal`)."""
        return cls.mixing_refusal() is None

    def scaled_range(self) -> ScaledRange | None:
        """What this encoding's linear scaling factor divides and how large it may grow (the
        bound :func:`hf_posenc.core.interpolation.check_scaled_range` enforces when patching and
        reconfiguring); None: unscaled, or no factor makes it unrepresentable."""
        return None

    def active_stages(self) -> list[str]:
        """Stages this instance runs; an encoding whose parameters switch paths overrides it."""
        return self.stages()

    # -- stages ---------------------------------------------------------------------
    def embed(self, call: ForwardCall) -> torch.Tensor:
        """``call.positions`` (B,T) int64 -> additive embedding (B,T,hidden) in fp32."""
        raise NotImplementedError

    def layer_input(self, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
        """``call.hidden`` (B,T,hidden) -> (input of the q/k projections, input of the v projection)."""
        raise NotImplementedError

    def adjust_qkv(
        self, call: LayerCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k, v (B,Hkv,T,D) fresh from the projections -> adjusted q, k, v."""
        raise NotImplementedError

    def rotate(self, call: LayerCall, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k (B,Hkv,T,D) of the new tokens at ``call.positions`` (B,T) -> rotated q, k.

        Encodings with ``takes_coordinates = True`` read ``call.coordinates`` (B|1,T,axes) or None."""
        raise NotImplementedError

    def logits(self, call: ScoreCall) -> torch.Tensor:
        """Raw (unscaled) q.k logits (B,Hq,Tq,Tk) fp32 from the un-rotated ``call.q``, ``call.k``
        at ``call.positions`` and ``call.key_positions``."""
        raise NotImplementedError

    def neighbour_split(self, call: ScoreCall) -> NeighbourSplit:
        """For a ``logits`` stage that is RoPE under one position map for the keys within a window
        of the query and another for the keys beyond (SelfExtend, ReRoPE): q and k rotated under
        both, so a backend can attend near and far keys in blocks (:mod:`hf_posenc.attention.neighbour`)
        without the (Tq, Tk) logits. Encodings that implement it say so by overriding it
        (:func:`splits_neighbours`)."""
        raise NotImplementedError

    def band_form(self, call: ScoreCall) -> BandForm:
        """For an explicit score stage that needs only a band of keys near each query, the rest of
        the row being the logit plus a per-query constant (a ``transform_scores`` stage: CoPE past
        its last position) or weights that are exactly 0 (a ``normalize`` stage: stick-breaking
        past fp32's underflow): the stage as a
        :class:`~hf_posenc.encodings.saturating_transform.BandForm`, so a backend can attend the
        far keys with a fused kernel or skip them (:mod:`hf_posenc.attention.saturating_band`).
        Encodings that implement it say so by overriding it (:func:`has_band_form`)."""
        raise NotImplementedError

    def score_bias(self, call: ScoreCall) -> BlockBias:
        """Additive logit bias of this call, fp32, in the most structured form that describes it
        (see :mod:`~hf_posenc.encodings.block_bias`); ``.full()`` is the (B|1, Hq, Tq, Tk) matrix.

        Queries and keys are indexed bottom-right aligned (query ``i`` sits at key index
        ``Tk - Tq + i``), so a bias of ``i - j`` is the distance in tokens. Left padding
        shifts both sides equally, so relative biases are padding-invariant. Called once per
        attention call, whatever the backend.
        """
        raise NotImplementedError

    def reads_position_ids(self) -> bool:
        """Whether this instance's attention depends on position ids (:attr:`reads_positions`,
        unless the configuration decides it, e.g. CAPE's base encoding)."""
        return self.reads_positions

    def rows_independent(self) -> bool:
        """True when ``transform_scores`` / ``normalize`` treat each query's row of scores on its
        own (given the keys it may attend): the explicit path may then run one block of queries
        at a time, each with its causal keys. Encodings that say so are tested for it."""
        return False

    def heads_independent(self) -> bool:
        """True when the explicit score stages (``logits``, ``transform_scores``, ``normalize``)
        compute each head's scores from that head's queries and keys alone, with the same
        parameters for every head: they may then run on any subset of the heads (a rank's heads
        under head-parallel attention). Encodings that say so are tested for it (two ranks equal
        one process)."""
        return False

    def transform_scores(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        """Scaled logits plus bias (B, Hq, Tq, Tk) fp32 -> new scores (masking comes after).

        ``call.allowed`` holds the mask that will be applied afterwards (None: every key allowed).
        """
        raise NotImplementedError

    def normalize(self, call: ScoreCall, scores: torch.Tensor) -> torch.Tensor:
        """scores (B,Hq,Tq,Tk) fp32 and ``call.allowed`` (B|1,1,Tq,Tk) bool, or None when every key
        is allowed -> attention weights."""
        raise NotImplementedError

    def attended_stream(self, call: LayerCall, k_len: int) -> torch.Tensor:
        """For ``attends_stream`` encodings: the (B, Hkv, Tk, S) vectors of the ``k_len`` keys this
        call attends (cached ones included; kept in ``call.state``), attended with the weights of
        the values: the output per query head is ``(sum_j a_ij v_j, sum_j a_ij s_j)``."""
        raise NotImplementedError

    def adjust_output(self, call: LayerCall, out: torch.Tensor) -> torch.Tensor:
        """Attention output (B, T, Hq*D) before the output projection -> adjusted output."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.to_dict().items())


def splits_neighbours(encoding: Encoding) -> bool:
    """Whether ``encoding`` gives its logits as a :class:`NeighbourSplit`."""
    return type(encoding).neighbour_split is not Encoding.neighbour_split


def has_band_form(encoding: Encoding) -> bool:
    """Whether ``encoding`` gives its explicit score stage as a :class:`BandForm`."""
    return type(encoding).band_form is not Encoding.band_form


def module_cache(module: nn.Module) -> dict[Any, Any]:
    """The dict of values ``module`` keeps between forwards (see :data:`CACHE_ATTRIBUTE`)."""
    return module.__dict__.setdefault(CACHE_ATTRIBUTE, {})


def clear_module_caches(root: nn.Module) -> None:
    """Drop what :func:`module_cache` holds on ``root`` and every submodule."""
    for module in root.modules():
        module.__dict__.pop(CACHE_ATTRIBUTE, None)
