"""Training-free context extension of a RoPE checkpoint with two position maps: one for the keys
near a query, one for the keys far from it (SelfExtend, ReRoPE, Leaky ReRoPE).

For the query at position i and the key at position j (padding-aware token positions), the
logit is RoPE's with positions that depend on the distance i - j:

    i - j <  window:  (R_i q_i) . (R_j k_j)                 neighbours: the checkpoint's RoPE
    i - j >= window:  (R_{a(i)} q_i) . (R_{b(j)} k_j)       far keys: a map that keeps every
                                                            distance inside the trained range

with the checkpoint's own RoPE settings (theta, partial rotary, scaling, per-layer theta; layers
the native model leaves position-free stay so). Each method defines (a, b) in
:meth:`WindowSplitRoPE.far_positions`. Keys are cached un-rotated (stage ``logits``) so every
decoding step rotates them under both maps for its own queries.

Two ways to compute it, equal up to rounding (tests compare both with an fp64 reference):

- ``logits`` (the eager backend: ``backend="eager"`` / ``"sdpa"``): the (B, H, Tq, Tk) scores of
  both maps, merged with ``where`` as LongLM's and ReRoPE's reference forwards do;
- :meth:`WindowSplitRoPE.neighbour_split` (the default ``backend="auto"``, also ``"chunked"``
  and ``"flex"``): the rotated queries and keys under both maps, from which the ``neighbour``
  backend (:mod:`hf_posenc.attention.neighbour`) attends in blocks of queries: the neighbour
  band and the far keys separately, merged by log-sum-exp as the papers' flash variants do; no
  (Tq, Tk) tensor exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..core.config import check_bool, check_number, fail
from ..core.decoding_state import appended
from ..core.layout import expand_kv_heads
from ..errors import InvalidParameterError
from .call import NeighbourSplit, ScoreCall
from .rope import RoPE, RoPEConfig, apply_rotary, cos_sin, model_layers
from .rope_scaling import LENGTH_DEPENDENT, inverse_frequencies, resolve_scaling


@dataclasses.dataclass
class WindowSplitConfig(RoPEConfig):
    """RoPE's settings (default: the checkpoint's own) plus the neighbour ``window``."""

    extends = "rope"  # a checkpoint trained with rope loads as these, with its RoPE settings
    native_positions = ""  # no native configuration attends with two position maps

    #: keys closer than this many positions keep their RoPE distance; default: a quarter of the
    #: model's trained length (max_position_embeddings); at most the trained length
    window: int | None = None
    #: decoding over a dynamic cache keeps the cached keys rotated under the far map (one more copy
    #: of the keys per layer) so a step rotates only its new keys; False: every step rotates them
    #: again (less memory, slower decoding; ReRoPE keeps nothing either way)
    keep_far_keys: bool = True

    def validate(self) -> None:
        super().validate()
        if self.window is not None:
            check_number(self.encoding, "window", self.window, low=1, integer=True)
        check_bool(self.encoding, "keep_far_keys", self.keep_far_keys)

    def resolve(self, geometry) -> WindowSplitConfig:
        layers = model_layers(geometry)
        if not any(layer.native_rotary for layer in layers):
            raise InvalidParameterError(
                f"{self.encoding}: the model's native positions are not RoPE ({geometry.family}: no layer "
                f"rotates q/k); allowed: a model whose native encoding is RoPE ({self.encoding} extends the "
                "checkpoint's own RoPE without training)"
            )
        out = super().resolve(geometry)
        assert isinstance(out, WindowSplitConfig)  # RoPEConfig.resolve copies with dataclasses.replace
        trained = int(geometry.max_position_embeddings)
        if out.window is None:
            out.window = max(1, trained // 4)
        if out.window > trained:
            raise fail(
                self.encoding,
                "window",
                out.window,
                f"an integer in [1, {trained}] (at most the model's trained length, max_position_embeddings)",
            )
        scalings = [out.scaling] if out.scaling != "model" else [layer.rope_scaling for layer in layers]
        for scaling in scalings:
            resolved = resolve_scaling(scaling, trained) if isinstance(scaling, dict) else None
            if resolved is not None and resolved["type"] in LENGTH_DEPENDENT:
                raise fail(
                    self.encoding,
                    "scaling",
                    resolved["type"],
                    "None, linear, ntk, yarn or llama3 (a RoPE whose frequencies do not change with the "
                    "length; pass scaling=None or another scaling to replace the checkpoint's)",
                )
        return out


#: a call rotates only the keys some query reads under a map when it has this many keys more than
#: queries (a decoding step over a long cache: the neighbours are the last ``window`` keys)
RANGE_MIN_SKIPPED = 256


def key_ranges(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> tuple[slice, slice]:
    """(near, far): the keys that some query of the call may see as a neighbour (key position above
    the query's minus ``window``, for some row) and as far (at or below it), each as one range of
    key indices covering every such key; ``slice(None)`` (all keys) for calls with about as many
    queries as keys (training, a prefill: both maps read nearly every key) and under
    ``torch.compile`` (the ranges read the positions' values). q_positions (B, Tq), k_positions
    (B, Tk). Exact whatever the order of the positions (packed documents): a key outside a range
    is outside it for every query."""
    q_len, k_len = q_positions.shape[-1], k_positions.shape[-1]
    if k_len - q_len < RANGE_MIN_SKIPPED or torch.compiler.is_compiling():
        return slice(None), slice(None)
    near = (k_positions > q_positions.amin(-1, keepdim=True) - window).any(0)  # (Tk,)
    far = (k_positions <= q_positions.amax(-1, keepdim=True) - window).any(0)  # (Tk,)
    index = torch.arange(k_len, device=k_positions.device)
    # the first neighbour key (k_len: none) and one past the last far key (0: none), in one sync
    near_from, far_to = torch.stack(
        (torch.where(near, index, k_len).amin(), torch.where(far, index + 1, 0).amax())
    ).tolist()
    return slice(near_from, k_len), slice(0, far_to)


#: decoding-state entries: the cache's keys rotated under the far map (B, Hkv, Tk, D), and per key
#: its far position and the map's frequency fingerprint (B, Tk, 2), which a step compares with its
#: own to find a stale entry (a reconfigured map, another cache's keys)
FAR_KEYS, FAR_CHECK = "window_split_far_keys", "window_split_far_check"


class WindowSplitRoPE(RoPE):
    """Base of the window-split encodings (not registered itself): subclasses give the far map."""

    # decoding over a dynamic cache keeps the cached keys rotated under the far map: their far
    # positions b(j) are the keys' own, so a step rotates only its new keys (see _far_keys)
    reuses_decoding_work = True
    state_sequence_dims = {FAR_KEYS: -2, FAR_CHECK: -2}

    def active_stages(self) -> list[str]:
        return ["logits"]  # keys cached un-rotated: each step rotates them under both maps

    def heads_independent(self) -> bool:
        return True  # both maps rotate every head alike; the split is decided by positions

    def far_positions(
        self, q_positions: torch.Tensor, k_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a(i) (B, Tq), b(j) (B, Tk)): the positions queries and keys rotate by for far pairs."""
        raise NotImplementedError

    def far_keys_unrotated(self) -> bool:
        """Whether the far map leaves every key where it is (b(j) = 0 for every key: ReRoPE, whose
        far pairs all sit at distance ``window`` through the query alone); then the far keys are
        the keys themselves, not rotated by zero angles (cos 1, sin 0: the same values)."""
        return False

    def neighbour_split(self, call: ScoreCall) -> NeighbourSplit:
        if call.key_positions is None:
            raise ValueError(f"{self.name}: the logits stage needs the key positions")
        q_pos, k_pos = call.positions, call.key_positions  # (B, Tq), (B, Tk)
        window = int(self.config.window)  # type: ignore[attr-defined]
        rotation = self.layer_rotations[call.layer_idx]
        if rotation is None:  # a natively position-free layer: both maps are no rotation at all
            return NeighbourSplit(window, call.q, call.k, call.q, call.k, q_pos, k_pos)
        theta, scaling = rotation
        # the same for every layer with this rotation in a forward (a few small operations each)
        inv_freq, factor = call.memo.get(
            ("window-split inv_freq", repr(rotation), str(call.q.device)),
            lambda: inverse_frequencies(self.dim, theta, scaling, device=call.q.device),
        )

        memo = call.memo  # (the helpers below close over the memo, not over the call and its q, k)

        def rotated_all(x: torch.Tensor, positions: torch.Tensor, role: str) -> torch.Tensor:
            """x (B, H, T, D) rotated by ``positions`` (B, T)."""
            # one cos/sin table per map, role, rotation and dtype in a forward, shared by the layers
            # (the rotation's backward keeps its tables: one copy per training step, not one per layer)
            key = ("window-split", role, repr(rotation), str(x.dtype), tuple(positions.shape))
            cos, sin = memo.get(
                key, lambda: cos_sin(positions, inv_freq, factor, x.dtype)
            )  # (B, 1, T, d_rot)
            return apply_rotary(x, cos, sin)

        def rotated(
            x: torch.Tensor, positions: torch.Tensor, role: str, keys: slice = slice(None)
        ) -> torch.Tensor:
            """x (B, H, T, D) rotated by ``positions`` (B, T); with ``keys``, only those keys, the
            others left 0 (no query of the call reads them under this map). Not recursive: a
            nested function that calls itself is a reference cycle, which kept every layer's q
            and k (its closure's) alive until Python's cyclic collector ran."""
            if keys == slice(None):
                return rotated_all(x, positions, role)
            # without gradients one zeros tensor per map and forward, shared by the layers: each
            # writes the same range (the ranges are the forward's), read before the next layer's
            out = (
                x.new_zeros(x.shape)
                if torch.is_grad_enabled()
                else memo.get(("window-split zeros", role, x.shape, x.dtype), lambda: x.new_zeros(x.shape))
            )  # (B, H, T, D)
            out[:, :, keys] = rotated_all(
                x[:, :, keys], positions[:, keys], f"{role} {keys.start}:{keys.stop}"
            )
            return out

        far_q_pos, far_k_pos = self.far_positions(q_pos, k_pos)
        # the same for every layer of a forward (one host sync, not one per layer)
        near_keys, far_keys = call.memo.get(
            ("window-split key ranges", window, tuple(q_pos.shape), tuple(k_pos.shape)),
            lambda: key_ranges(q_pos, k_pos, window),
        )
        if self.far_keys_unrotated():
            far_k = call.k
        else:
            kept = self._far_keys(call, far_k_pos, inv_freq, factor, rotated)
            far_k = rotated(call.k, far_k_pos, "far k", far_keys) if kept is None else kept
        return NeighbourSplit(
            window,
            near_q=rotated(call.q, q_pos, "near q"),
            near_k=rotated(call.k, k_pos, "near k", near_keys),
            far_q=rotated(call.q, far_q_pos, "far q"),
            far_k=far_k,
            q_positions=q_pos,
            k_positions=k_pos,
        )

    def _far_keys(
        self,
        call: ScoreCall,
        far_positions: torch.Tensor,
        inv_freq: torch.Tensor,
        factor: float,
        rotated: Callable[..., torch.Tensor],
    ) -> torch.Tensor | None:
        """The keys rotated under the far map, (B, Hkv, Tk, D), from this layer's decoding state:
        the kept ones and this call's new keys (the last Tq) rotated now; None (rotate them as
        without a cache) under gradients or without a state. A state that does not line up with
        the cache (another model filled it, a static cache, a reconfigured map) is rebuilt from
        all the keys. Sliding-window caches drop their oldest keys: so does the state."""
        state = call.state
        if state is None or torch.is_grad_enabled() or not self.config.keep_far_keys:  # type: ignore[attr-defined]
            return None
        k, q_len, k_len = call.k, call.q.shape[-2], call.k.shape[-2]

        def far_check() -> torch.Tensor:  # (B, Tk, 2): each key's far position, the rotation's fingerprint
            fingerprint = (inv_freq.double() / factor).sum()  # a changed rotation changes it
            return torch.stack((far_positions.double(), fingerprint.expand(far_positions.shape)), -1)

        # the same for every layer with this rotation in a forward (the positions are the forward's)
        rotation = repr(self.layer_rotations[call.layer_idx])
        check = call.memo.get(("window-split far check", rotation, tuple(far_positions.shape)), far_check)
        kept, seen = state.get(FAR_KEYS), state.get(FAR_CHECK)
        if (
            kept is not None
            and seen is not None
            and kept.dtype == k.dtype
            and kept.shape[0] == k.shape[0]
            and kept.shape[-2] + q_len >= k_len >= q_len
        ):
            new = rotated(k[:, :, -q_len:], far_positions[:, -q_len:], "far k new")  # (B, Hkv, Tq, D)
            keys = appended(kept, new)[:, :, -k_len:]  # (B, Hkv, Tk, D)
            seen = appended(seen, check[:, -q_len:])[:, -k_len:]  # (B, Tk, 2)
            if torch.equal(seen, check):  # the kept keys' far positions and rotation are this call's
                state[FAR_KEYS], state[FAR_CHECK] = keys, seen
                return keys
        keys = rotated(k, far_positions, "far k")  # every key: the state starts here
        state[FAR_KEYS], state[FAR_CHECK] = keys, check
        return keys

    def logits(self, call: ScoreCall) -> torch.Tensor:
        """Both maps' (B, Hq, Tq, Tk) fp32 logits, the neighbours' where i - j < window."""
        split = self.neighbour_split(call)
        groups = call.q.shape[1] // call.k.shape[1]
        dtype = torch.promote_types(call.q.dtype, torch.float32)

        def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            k = expand_kv_heads(k, groups)  # (B, Hq, Tk, D)
            return torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2))

        near = split.is_near(slice(None), slice(None))  # (B, 1, Tq, Tk)
        return torch.where(near, scores(split.near_q, split.near_k), scores(split.far_q, split.far_k))
