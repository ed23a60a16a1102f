"""fp64 models: every encoding runs in a model cast to float64, and where its arithmetic follows
the model's dtype, token-by-token decoding with a KV cache equals the full forward to fp64's
rounding. A part computed in fp32 inside an fp64 model shows here as a difference of fp32's
rounding (~1e-6): the explicit-score core and CAPE's mixer rounded their scores to fp32 until
2026-11-27 (every CAPE case differed by 1.4e-6 to 2.6e-6), and FoPE's rotation failed outright
("expected scalar type Float but found Double").
"""

from __future__ import annotations

import pytest
import torch
from conftest import decoded_and_full_logits, make_model, patch, token_ids
from encoding_cases import CASES_BY_ENCODING

#: encodings that compute part of their formula in fp32 whatever the model's dtype, by design
FP32_INSIDE = {
    # their rotations come from an fp32 matrix exponential / eigenbasis (ComRoPE's
    # ``matrix_exp_dtype`` option, LieRE's polar steps), then rotate in fp32
    "comrope": "rotation matrices in fp32",
    "liere": "rotation matrices in fp32",
    # the stick-breaking weights are flushed to 0 below fp32's smallest normal, as the band
    # backend's (saturating_band) reads them: the weights are fp32 by definition here
    "sba": "stick-breaking weights in fp32",
    # its token shift, QK-norm, output norm and gates run in fp32 (``fox_pro.rms_norm``,
    # ``token_shift``): 1.2e-8 at two of the lengths measured
    "fox_pro": "shift, norms and gates in fp32",
}
#: decoding against the full forward of an fp64 model (fp64 rounding: the runs measured 0.9e-15
#: to 2.2e-15 on these models)
FP64_ATOL = 1e-12
#: the same for the fp32-inside encodings (fp32 rounding: 1.2e-8 to 1.6e-6 measured)
FP32_INSIDE_ATOL = 1e-5


@pytest.mark.parametrize("name", sorted(CASES_BY_ENCODING))
def test_an_fp64_model_decodes_as_its_full_forward(name):
    """A patched Llama cast to float64 gives finite fp64 logits, and decoding its second half
    token by token from a cache equals the full forward over the same prefix at every step,
    to fp64's rounding (to fp32's for :data:`FP32_INSIDE`)."""
    params = CASES_BY_ENCODING[name][0][1]
    model = patch(make_model("llama"), name, params).double()
    atol = FP32_INSIDE_ATOL if name in FP32_INSIDE else FP64_ATOL
    for t, (step, full) in enumerate(decoded_and_full_logits(model, token_ids(2, 12), prompt=6), start=6):
        assert full.dtype == step.dtype == torch.float64
        assert torch.isfinite(full).all()
        torch.testing.assert_close(step, full, atol=atol, rtol=0, msg=f"{name}, {t} tokens")
