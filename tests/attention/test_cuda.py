"""On a GPU: what backend="auto" runs there (compiled FlexAttention with its kernel ladder,
flash-attn / flash-linear-attention where installed, chunked) gives eager's gradients and
cached decoding, and trains at two lengths of one length bucket with one compilation. Forward
logits: test_backends.py::test_cuda_auto_backend_equals_eager.
Skipped on machines without CUDA (CI); run on a GPU with ``pytest tests/attention -k cuda``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, patch, token_ids
from encoding_cases import BLOCK_CASES, case_ids

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def _pair(name: str, params: dict):
    models = {b: patch(make_model("llama"), name, params, backend=b).cuda() for b in ("eager", "auto")}
    models["auto"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    return models


@CUDA
@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_cuda_auto_gradients_equal_eager(case):
    """fp32, 2 x 300 tokens (FlexAttention serves >= 128 queries): every parameter's gradient,
    the encoding's learned tables included (captured-buffer gradients), within 1e-4 of eager's
    (GPU kernels sum in another order)."""
    name, params = case
    models = _pair(name, params)
    ids = token_ids(2, 300).cuda()
    grads = {}
    for backend, model in models.items():
        model(ids, labels=ids).loss.backward()
        grads[backend] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["auto"].keys() == grads["eager"].keys()
    for parameter, reference in grads["eager"].items():
        torch.testing.assert_close(grads["auto"][parameter], reference, atol=1e-4, rtol=1e-3, msg=parameter)


@CUDA
@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_cuda_auto_cached_decoding_equals_eager_full_forward(case):
    """A 200-token prompt then 8 tokens one at a time with a KV cache on auto equal eager's one
    forward over all 208 (fp32, 1e-4): the prompt through the fused kernel, the steps not."""
    from transformers import DynamicCache

    name, params = case
    models = _pair(name, params)
    ids = token_ids(1, 208).cuda()
    with torch.no_grad():
        reference = models["eager"](ids).logits
        model = models["auto"]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :200], past_key_values=cache, use_cache=True).logits]
        for t in range(200, 208):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=1e-4, rtol=0)


@CUDA
@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_cuda_training_at_two_lengths_of_one_bucket_compiles_once(case):
    """Training batches of 300, 270 and 384 tokens (left-padded row included) run FlexAttention at
    one length bucket (384; the last unpadded, so its q, k and v strides must match the padded
    calls'): every parameter's gradient of the loss over the real tokens (not the first real
    token, which a fully masked padding query predicts) within 1e-4 of eager's at each length, and
    torch's compile counter does not move after the first length (no recompilation per length)."""
    from torch._dynamo.utils import counters

    import hf_posenc.attention.flex as flex

    assert flex.bucket_length(300) == flex.bucket_length(270) == flex.bucket_length(384) == 384
    name, params = case
    models = _pair(name, params)
    counters.clear()
    graphs = None
    for length in (300, 270, 384):
        ids = token_ids(2, length, seed=length).cuda()
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :5] = 0
        labels = ids.masked_fill(attention_mask == 0, -100)
        labels[1, 5] = -100  # predicted from the last padding position, whose output is not defined
        grads = {}
        for backend, model in models.items():
            model.zero_grad(set_to_none=True)
            model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
            grads[backend] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        for parameter, reference in grads["eager"].items():
            torch.testing.assert_close(
                grads["auto"][parameter], reference, atol=1e-4, rtol=1e-3, msg=parameter
            )
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
