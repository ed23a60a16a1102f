"""Every attention backend gives the eager reference's outputs and gradients.

The chunked backend (query blocks over SDPA, Toeplitz biases as strided views) and the
FlexAttention backend (uncompiled off CUDA) are checked against ``backend="eager"`` (explicit
fp32 scores) at fp32 atol 1e-5, for every encoding with a score bias (BLOCK_CASES) and with
explicit scores (ROW_CASES, tests/encoding_cases.py), and every encoding on every ``backend=``
choice. Blocks are made tiny (5 queries) so every input spans several of them. The block core
against an fp64 softmax and the views of a score bias: test_block_bias.py; the CUDA kernels'
stand-ins: test_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_model, patch, token_ids
from encoding_cases import BLOCK_CASES, ROW_CASES, case_ids

import hf_posenc
import hf_posenc.attention.chunked as chunked
import hf_posenc.attention.saturated as saturated
import hf_posenc.attention.saturating_band as saturating_band

ATOL = 1e-5
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)


def test_block_cases_cover_every_encoding_with_a_score_bias():
    with_bias = {info.name for info in hf_posenc.list_encodings() if "score_bias" in info.stages}
    assert with_bias == {name for name, _ in BLOCK_CASES}


def _models(family: str, name: str, params: dict, backends: tuple[str, ...]):
    models = {backend: patch(make_model(family), name, params, backend=backend) for backend in backends}
    state = models["eager"].posenc.state_dict()
    for model in models.values():
        model.posenc.load_state_dict(state)
    return models


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
# flex on CPU (uncompiled FlexAttention) is seconds per case: slow here; the quick run keeps
# test_flex_serves_every_block_encoding_without_falling_back
@pytest.mark.parametrize("backend", ["chunked", pytest.param("flex", marks=pytest.mark.slow), "auto"])
def test_block_backend_logits_equal_eager_with_and_without_left_padding(family, case, backend):
    """One forward of 2 x 17 tokens (row 1 left-padded by 4; Mistral's window is 8)."""
    name, params = case
    models = _models(family, name, params, ("eager", backend))
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        reference = models["eager"](ids).logits
        padded_reference = models["eager"](ids, attention_mask=mask).logits
        logits = models[backend](ids).logits
        padded = models[backend](ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[0], padded_reference[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(padded[1, 4:], padded_reference[1, 4:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_decoding_with_a_cache_equals_the_eager_full_forward(family, case):
    """Prefill 11 tokens (3 blocks) then 3 single-token steps and one 4-token step."""
    from transformers import DynamicCache

    name, params = case
    models = _models(family, name, params, ("eager", "chunked"))
    ids = token_ids(1, 18)
    with torch.no_grad():
        full = models["eager"](ids).logits
        model = models["chunked"]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :11], past_key_values=cache, use_cache=True).logits]
        for start, stop in [(11, 12), (12, 13), (13, 14), (14, 18)]:
            steps.append(model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_chunked_gradients_equal_eager_gradients(family, case):
    """Loss gradients of every parameter (model and encoding) match, so training is the same;
    the padded rows go through the per-block path with recomputation in backward. ``flex``
    off CUDA (no FlexAttention backward there) trains through ``chunked`` and matches too."""
    name, params = case
    models = _models(family, name, params, ("eager", "chunked", "flex"))
    ids = token_ids(2, 13)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    grads = {}
    for backend, model in models.items():
        model.train()
        for attention_mask in (None, mask):
            model.zero_grad()
            labels = ids.clone()
            if attention_mask is not None:
                labels[1, :3] = -100  # the first real token is predicted from a padded position
            model(ids, attention_mask=attention_mask, labels=labels).loss.backward()
            grads[backend, attention_mask is None] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
    for plain, backend in [(True, "chunked"), (False, "chunked"), (True, "flex"), (False, "flex")]:
        eager, blocks = grads["eager", plain], grads[backend, plain]
        assert eager.keys() == blocks.keys()
        assert any(n.startswith("posenc.") for n in eager) == bool(list(models["eager"].posenc.parameters()))
        for n in eager:
            torch.testing.assert_close(blocks[n], eager[n], atol=ATOL, rtol=1e-4, msg=n)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_flex_serves_every_block_encoding_without_falling_back(case, monkeypatch):
    """Without gradients (FlexAttention has no CPU backward) flex itself serves each encoding."""

    def no_fallback(*args, **kwargs):
        raise AssertionError("fell back to the chunked backend")

    name, params = case
    models = _models("llama", name, params, ("eager", "flex"))
    monkeypatch.setattr(chunked, "attend_chunked", no_fallback)
    ids = token_ids(2, 17)
    with torch.no_grad():
        torch.testing.assert_close(models["flex"](ids).logits, models["eager"](ids).logits, atol=ATOL, rtol=0)


def test_auto_uses_the_chunked_core_on_cpu_and_sdpa_does_not(monkeypatch):
    calls = []
    original = chunked.attend_chunked
    monkeypatch.setattr(chunked, "attend_chunked", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = token_ids(1, 9)
    with torch.no_grad():
        patch(make_model("llama"), "alibi")(ids)
        assert len(calls) == 2  # one per layer
        patch(make_model("llama"), "alibi", backend="sdpa")(ids)
        patch(make_model("llama"), "rope")(ids)  # no score bias: the plain core
    assert len(calls) == 2


@CUDA
@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_auto_backend_equals_eager(case, dtype):
    """On a GPU: flash-attn ALiBi / compiled FlexAttention / chunked equal eager. fp32: within 1e-4
    (GPU kernels accumulate in another order than the eager matmul + softmax; measured up to 3.7e-5
    on an H100). bf16: the fused path is no further from the fp32 eager reference than the eager
    path in bf16 is (twice its error plus bf16's resolution at these logits, 1/64)."""
    name, params = case
    models = _models("llama", name, params, ("eager", "auto"))
    ids = token_ids(2, 300).cuda()
    with torch.no_grad():
        reference = models["eager"].cuda()(ids).logits.float()
        logits = [models[b].cuda().to(dtype)(ids).logits.float() for b in ("eager", "auto")]
    if dtype == torch.float32:
        torch.testing.assert_close(logits[1], reference, atol=1e-4, rtol=0)
        return
    eager_error = (logits[0] - reference).abs().max().item()
    fused_error = (logits[1] - reference).abs().max().item()
    assert fused_error <= 2 * eager_error + 1 / 64, (fused_error, eager_error)


@pytest.mark.parametrize("case", ROW_CASES, ids=case_ids(ROW_CASES))
@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_explicit_score_encodings_in_query_blocks_equal_eager(family, case):
    """auto runs cope/cape/sba one block of queries at a time (each with its causal keys):
    logits with and without left padding, gradients, and cached decoding equal eager's."""
    from transformers import DynamicCache

    name, params = case
    models = _models(family, name, params, ("eager", "auto"))
    assert models["auto"].posenc.rows_independent()
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.clone()
    labels[1, :5] = -100  # positions predicted from padding
    outputs = {}
    for backend, model in models.items():
        model.zero_grad()
        plain = model(ids)
        padded = model(ids, attention_mask=mask, labels=labels)
        padded.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            steps = [model(ids[:1, :12], past_key_values=cache, use_cache=True).logits]
            steps.append(model(ids[:1, 12:], past_key_values=cache, use_cache=True).logits)
        outputs[backend] = (plain.logits.detach(), padded.logits.detach(), grads, torch.cat(steps, dim=1))
    (p_e, pad_e, g_e, _), (p_a, pad_a, g_a, steps_a) = outputs["eager"], outputs["auto"]
    torch.testing.assert_close(p_a, p_e, atol=ATOL, rtol=0)
    torch.testing.assert_close(pad_a[0], pad_e[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(pad_a[1, 4:], pad_e[1, 4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps_a, p_e[:1], atol=ATOL, rtol=0)
    assert g_a.keys() == g_e.keys()
    for n in g_e:
        torch.testing.assert_close(g_a[n], g_e[n], atol=ATOL, rtol=1e-4, msg=n)


#: registered backends that serve only on CUDA with an optional package, each covered by a test in
#: tests/attention/test_kernels.py with a stand-in kernel written from the package's documented semantics
STAND_IN_TESTS = {
    "flash_alibi": "test_flash_alibi_path_passes_bthd_layout_causal_and_the_slopes",
    "fla_forgetting": "test_fla_forgetting_path_passes_bthd_layout_and_log_gates",
    "fla_stickbreaking": "test_fla_stickbreaking_path_equals_the_eager_sba",
}


#: cases beside every encoding's defaults, for backends the defaults do not reach at 17 tokens:
#: t5 whose last bucket starts at W = 8 (the saturated backend, its length floor lowered below,
#: serves lengths past W); cope
#: counting to 2 positions, so that its rows saturate within the 17 tokens (the saturating band,
#: with its blocks and first band width made small below, then attends far keys)
EXTRA_CASES = [("t5", {"num_buckets": 8, "max_distance": 12}), ("cope", {"npos_max": 2})]


def test_row_cases_cover_every_encoding_with_explicit_score_stages():
    explicit = {"transform_scores", "normalize"}
    with_rows = {info.name for info in hf_posenc.list_encodings() if explicit & set(info.stages)}
    assert with_rows == {name for name, _ in ROW_CASES}


def test_every_encoding_on_every_backend_choice_equals_eager_and_every_backend_is_covered(monkeypatch):
    """Every registered encoding, patched with every ``backend=`` choice, gives eager's logits (with
    and without left padding); the backends that served, plus the CUDA kernels' stand-in tests,
    are every registered backend (a new backend must join this matrix or name its own test)."""
    import hf_posenc.attention as attention

    served: set[str] = set()
    for backend in attention.registered_backends():
        original = backend.attend

        def spy(call, backend=backend, original=original):
            result = original(call)
            if result is not None:
                served.add(backend.name)
            return result

        monkeypatch.setattr(backend, "attend", spy)
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 5)
    monkeypatch.setattr(saturating_band, "BLOCK", 4)
    monkeypatch.setattr(saturating_band, "BAND_KEYS", 4)
    monkeypatch.setattr(saturated, "LONGER_THAN", 0)  # (it serves long calls only)
    ids = token_ids(2, 17)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cases = [(info.name, {}) for info in hf_posenc.list_encodings()] + EXTRA_CASES
    for name, params in cases:
        models = _models("llama", name, params, attention.BACKENDS)
        with torch.no_grad():
            reference = models["eager"](ids).logits
            padded_reference = models["eager"](ids, attention_mask=mask).logits
            for choice, model in models.items():
                logits = model(ids).logits
                padded = model(ids, attention_mask=mask).logits
                msg = f"{name} {params} backend={choice}"
                torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0, msg=msg)
                torch.testing.assert_close(padded[0], padded_reference[0], atol=ATOL, rtol=0, msg=msg)
                torch.testing.assert_close(padded[1, 4:], padded_reference[1, 4:], atol=ATOL, rtol=0, msg=msg)
    registered = {backend.name for backend in attention.registered_backends()}
    kernel_tests = (Path(__file__).parent / "test_kernels.py").read_text()
    assert all(f"def {name}(" in kernel_tests for name in STAND_IN_TESTS.values())
    assert served | set(STAND_IN_TESTS) == registered, registered - served - set(STAND_IN_TESTS)


def test_a_backend_failure_is_remembered_per_model_not_per_process(monkeypatch):
    """A backend that fails (as FlexAttention does when a kernel cannot compile: it adds itself to
    the call's ``failures``) is not asked again by that model, and still is by another model."""
    from hf_posenc.attention import backend as registry
    from hf_posenc.core.patch import PATCH_ATTRIBUTE

    asked = []

    class Failing(registry.Backend):
        name = "failing_for_test"
        priority = 1000
        requests = frozenset({"auto"})

        def serves(self, call):
            return True

        def attend(self, call):
            asked.append(id(call.failures))
            call.failures.add(self.name)
            return None  # the dispatcher goes on to the next backend

    monkeypatch.setitem(registry._REGISTRY, Failing.name, Failing())
    first, second = patch(make_model("llama"), "alibi"), patch(make_model("llama"), "alibi")
    ids = token_ids(1, 9)
    with torch.no_grad():
        reference = first(ids).logits
        torch.testing.assert_close(first(ids).logits, reference)
        torch.testing.assert_close(second(ids).logits, second(ids).logits)
    runtimes = [getattr(model, PATCH_ATTRIBUTE).runtime.parts[0] for model in (first, second)]
    assert asked == [id(runtimes[0].failed_backends), id(runtimes[1].failed_backends)]
    assert all(runtime.failed_backends == {Failing.name} for runtime in runtimes)
