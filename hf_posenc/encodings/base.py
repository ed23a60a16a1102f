"""The contract every encoding implements: any subset of five stages.

1. ``embed``        absolute vector added to the token embeddings (sinusoidal, learned);
2. ``layer_input``  rewrite the hidden states entering the q/k(/v) projections (ExPE, ExQPE);
3. ``rotate``       transform q and k from their positions (the RoPE family);
4. ``logits``       compute q.k itself when no per-token transform of q and k can
                    (per-query frequencies of dynamic NTK RoPE); keys are cached raw;
5. ``score_bias``   additive term on the attention logits (T5, ALiBi, ...).

A stage an encoding does not override costs nothing: the attention core skips it.
New parameters are registered on the encoding module, which the patch attaches to the
model as ``model.posenc`` so they are trained, saved, reloaded and moved with ``.to()``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..config import FORMAT_VERSION, EncodingConfig
from ..memo import ForwardMemo
from ..models.base import ModelGeometry

MARKER_BUFFER = "reload_with_hf_posenc_from_pretrained"
STAGES = ("embed", "layer_input", "rotate", "logits", "score_bias")


class Encoding(nn.Module):
    """Base class. Subclasses set the class attributes and override the stages they use."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    config_class: ClassVar[type[EncodingConfig]] = EncodingConfig
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, config: EncodingConfig, geometry: ModelGeometry) -> None:
        super().__init__()
        self.config = config
        self.geometry = geometry
        # A plain transformers load of a saved patched model reports this key as unexpected,
        # so dropping the patch is never silent, even for encodings without parameters.
        self.register_buffer(MARKER_BUFFER, torch.tensor(FORMAT_VERSION), persistent=True)

    def initialise_from_model(self, model: nn.Module, adapter) -> None:
        """Run once when patching a model (not when reloading one): e.g. copy a native table."""

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
        """q (B,Hq,Tq,D), k (B,Hkv,Tk,D) with positions (B,Tq), (B,Tk) -> rotated q, k."""
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

    def score_bias(
        self, layer_idx: int, q_len: int, k_len: int, device: torch.device, memo: ForwardMemo
    ) -> torch.Tensor:
        """Additive logit bias (Hq, Tq, Tk), fp32, for the last ``q_len`` of ``k_len`` keys.

        Queries and keys are indexed bottom-right aligned (query ``i`` sits at key index
        ``k_len - q_len + i``), so a bias of ``i - j`` is the distance in tokens. Left
        padding shifts both sides equally, so relative biases are padding-invariant.
        """
        raise NotImplementedError

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.to_dict().items())


def query_key_distance(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) int64 matrix of ``i - j`` in key-index space, bottom-right aligned."""
    q_index = torch.arange(k_len - q_len, k_len, device=device)
    k_index = torch.arange(k_len, device=device)
    return q_index[:, None] - k_index[None, :]
