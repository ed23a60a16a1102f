"""GPT-2 adapter: fused Conv1D ``c_attn``, learned absolute positions in ``wpe``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .base import FamilyAdapter, ModelGeometry, Undo, freeze_parameters, replace_forward


class ZeroPositions:
    """Stand-in forward of ``wpe`` while patched: a zero that broadcasts against the token
    embeddings. An object, not a closure, so copies and pickles of the model carry their own."""

    def __init__(self, wpe: nn.Embedding) -> None:
        self.wpe = wpe

    def __call__(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.wpe.weight.new_zeros(())


class GPT2Adapter(FamilyAdapter):
    family = "gpt2"
    model_types = ("gpt2",)

    def check_supported(self, model: nn.Module) -> None:
        if getattr(model.config, "add_cross_attention", False):
            raise UnsupportedModelError(
                "gpt2 with add_cross_attention=True is not supported: only decoder-only self-attention "
                "can be patched"
            )

    def geometry(self, config: Any) -> ModelGeometry:
        heads = config.n_head
        return ModelGeometry(
            family=self.family,
            hidden_size=config.n_embd,
            num_layers=config.n_layer,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=config.n_embd // heads,
            max_position_embeddings=config.n_positions,
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
            learned_position_table=True,
        )

    def native_position_table(self, model: nn.Module) -> torch.Tensor:
        return self.base_model(model).wpe.weight

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [block.attn for block in self.base_model(model).h]

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        wpe = self.base_model(model).wpe
        # wpe keeps its weights (saved, reloaded, restored by unpatch) but gets no gradient.
        return [replace_forward(wpe, ZeroPositions(wpe)), freeze_parameters(wpe)]

    def project(self, module, x_qk, x_v):
        d = module.split_size
        shape = (*x_qk.shape[:-1], -1, module.head_dim)  # (B, T, H, D)
        q, k, v = module.c_attn(x_qk).split(d, dim=-1)
        if x_v is not x_qk:  # ExPE without the value override: v from the original input
            v = module.c_attn(x_v)[..., 2 * d :]
        return (
            q.reshape(shape).transpose(1, 2),
            k.reshape(shape).transpose(1, 2),
            v.reshape(shape).transpose(1, 2),
        )

    def output(self, module, attn):
        return module.resid_dropout(module.c_proj(attn))

    def dropout_p(self, module) -> float:
        return module.attn_dropout.p if module.training else 0.0
