"""GPT-2 adapter: fused Conv1D ``c_attn``, learned absolute positions in ``wpe``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import (
    FamilyAdapter,
    LayerGeometry,
    ModelGeometry,
    Undo,
    describe_layers,
    freeze_parameters,
    replace_forward,
)
from .registry import register_family

#: config values GPT-2's attention and embeddings do not apply: anything else is refused
GPT2_NEUTRAL_CONFIG = {
    "add_cross_attention": (None, False),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "scale_embedding": (None, False),
}


class ZeroPositions:
    """Stand-in forward of ``wpe`` while patched: a zero that broadcasts against the token
    embeddings. An object, not a closure, so copies and pickles of the model carry their own."""

    def __init__(self, wpe: nn.Embedding) -> None:
        self.wpe = wpe

    def __call__(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.wpe.weight.new_zeros(())


@register_family
class GPT2Adapter(FamilyAdapter):
    family = "gpt2"
    model_types = ("gpt2",)
    lora_targets = ("c_attn", "c_proj", "c_fc")
    lora_fan_in_fan_out = True  # Conv1D stores weights transposed
    test_config_overrides = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

    def check_supported(self, model: nn.Module) -> None:
        self.refuse_config_values(model.config, GPT2_NEUTRAL_CONFIG)
        base = self.base_model(model)
        self.require_modules(base, ("h", "wpe"), "decoder stack")
        for block in base.h:
            self.require_modules(block, ("attn",), "decoder block")
            self.require_attention_class(block.attn, ("GPT2Attention",))
            self.require_modules(block.attn, ("c_attn", "c_proj"), "attention")

    def native_position_limit(self, config: Any) -> tuple[int, str] | None:
        return int(config.n_positions), "native GPT-2's n_positions={}"

    def tiny_config(
        self, *, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_positions, **special_tokens
    ):
        """GPT-2 has no grouped-query attention: ``num_kv_heads`` is ignored."""
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_positions=max_positions,
            **special_tokens,
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
            rotary_positions=False,
            layers=tuple(
                LayerGeometry(rope_theta=10000.0, native_rotary=False, softmax_scale=self._scale(config, i))
                for i in range(config.n_layer)
            ),
        )

    @staticmethod
    def _scale(config: Any, index: int) -> float:
        """GPT-2's softmax scale: 1/sqrt(head_dim) (``scale_attn_weights``), divided by the
        layer number when ``scale_attn_by_inverse_layer_idx``."""
        scale = (config.n_embd // config.n_head) ** -0.5 if config.scale_attn_weights else 1.0
        return scale / (index + 1) if config.scale_attn_by_inverse_layer_idx else scale

    def native_position_table(self, model: nn.Module) -> torch.Tensor:
        return self.base_model(model).wpe.weight

    def export_positions(
        self,
        model: nn.Module,
        layers: list[tuple[str, str, dict[str, Any]]],
        tensors: dict[str, torch.Tensor],
    ) -> str | None:
        """GPT-2's native positions are its learned table: a table encoding (unscaled) becomes ``wpe``
        with ``n_positions`` = the table's rows."""
        if {kind for kind, _, _ in layers} != {"table"}:
            return f"its native positions are a learned table (wpe), not {describe_layers(layers)}"
        if layers[0][2].get("scaling") is not None:
            return "a learned table read with linear interpolation (scaling) is not a plain table lookup"
        table = tensors["table"]  # (max_positions, hidden)
        base = self.base_model(model)
        wpe = nn.Embedding(table.shape[0], table.shape[1], dtype=table.dtype, device=base.wpe.weight.device)
        with torch.no_grad():
            wpe.weight.copy_(table)
        base.wpe = wpe
        config: Any = model.config
        config.n_positions = int(table.shape[0])
        return None

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
