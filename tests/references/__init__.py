"""Formula references: one module per encoding (or per group of encodings sharing a formula,
as FoX and FoX (Pro), ReRoPE and Leaky ReRoPE), named like its module in hf_posenc/encodings,
the way flash-linear-attention keeps a ``naive.py`` beside each kernel.

Each is written from the paper's formulas with loops and explicit matrices in fp64 and reads only
the model's weights and the encoding's raw parameters; nothing here imports hf_posenc, so the
tests compare the package against something it did not compute. A module gives

- ``layer_reference(params, module, hidden, model, layer_idx)``: one attention layer's output
  (B, T, hidden) from its captured input ``hidden``, or
- ``model_reference(params, model, attention, records)``: every layer's output at once, for an
  encoding whose state runs across layers (TAPE's positional stream),

plus the formula pieces other tests check directly (``alibi.alibi_slopes``, ``t5.t5_bucket``,
``rope.rotation_matrix``, ...). The shared loops (projections, softmax over allowed keys, output
projection) are in :mod:`references.attention`; what a model's config states (sliding window,
query heads, native RoPE) in :mod:`references.config`. Beside them, :mod:`references.perplexity`
writes the recipes' length-extrapolation loss by hand.

To add an encoding's reference: write ``references/<name>.py`` with its formula in the module
docstring and a ``layer_reference`` (or ``model_reference``), register it in ``REFERENCES``
below, and give its cases in ``tests/encodings/test_formula_references.py``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import (
    alibi,
    cape,
    comrope,
    cope,
    expe,
    exqpe,
    fire,
    fope,
    fox,
    kerple,
    learned,
    liere,
    nope,
    rerope,
    rope,
    rope2d,
    sandwich,
    sba,
    selfextend,
    sinusoidal,
    t5,
    tape,
    xpos,
)

#: encoding name -> the module holding its formula reference
REFERENCES: dict[str, ModuleType] = {
    "nope": nope,
    "sinusoidal": sinusoidal,
    "learned": learned,
    "t5": t5,
    "alibi": alibi,
    "rope": rope,
    "xpos": xpos,
    "selfextend": selfextend,
    "rerope": rerope,
    "leaky_rerope": rerope,
    "expe": expe,
    "exqpe": exqpe,
    "kerple": kerple,
    "sandwich": sandwich,
    "fire": fire,
    "cope": cope,
    "sba": sba,
    "cape": cape,
    "fox": fox,
    "fox_pro": fox,
    "liere": liere,
    "fope": fope,
    "rope2d": rope2d,
    "comrope": comrope,
    "tape": tape,
}


def layer_reference(
    name: str, params: dict, module, hidden: torch.Tensor, model, layer_idx: int
) -> torch.Tensor:
    """Layer ``layer_idx``'s attention output (B, T, hidden) fp64 by encoding ``name``'s formula."""
    return REFERENCES[name].layer_reference(params, module, hidden, model, layer_idx)


def attention_outputs(name: str, params: dict, model, attention, records) -> list[torch.Tensor]:
    """Every attention layer's output (B, T, hidden) fp64 by encoding ``name``'s formula, from the
    inputs ``records[layer] = (hidden, output)`` captured by tests/capture.py."""
    reference = REFERENCES[name]
    if hasattr(reference, "model_reference"):
        return reference.model_reference(params, model, attention, records)
    return [
        reference.layer_reference(params, module, records[layer][0], model, layer)
        for layer, module in enumerate(attention)
    ]
