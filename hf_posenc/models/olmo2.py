"""OLMo 2 adapter: Llama's layout with an RMSNorm over the *whole* query and key projections,
before they are split into heads, then RoPE (OLMo et al., "2 OLMo 2 Furious",
arXiv:2501.00656, 2024):

    q = RMSNorm_q(x W_q^T),   k = RMSNorm_k(x W_k^T)   (weights of size heads*head_dim)

The norm is part of the family's projection: ``rotate`` encodings rotate the normalised q/k as
OLMo 2 itself does; ExPE/ExQPE codes enter with the hidden state before the projection and so
pass through it and its norm (see ``qwen3.py``); score biases add to the normalised q.k.
OLMo 2's other difference from Llama, norms after the attention and MLP blocks instead of
before, lives in the decoder layer, which the patch leaves as it is.
"""

from __future__ import annotations

from .llama import LlamaAdapter
from .registry import register_family


@register_family
class Olmo2Adapter(LlamaAdapter):
    family = "olmo2"
    model_types = ("olmo2",)
    attention_classes = ("Olmo2Attention",)
    config_class_name = "Olmo2Config"
    qk_norm = "projection"
