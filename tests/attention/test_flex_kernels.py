"""Compiled FlexAttention: the kernel-options ladder, per-kind fallback, decoding kept off it.

The ladder (hf_posenc/attention/flex_kernels.py) is checked with an injected out-of-resource
error on its first rung (the failure a GPU gives; CPU builds never run out of shared memory):
the next rung serves, the choice is recorded per kind of call and in ``patch_info``, a backward
failure is caught by the probe before a loss's backward would meet it, and only the kind whose
every rung failed falls back. The compiled forward itself is run on CPU for every bias form
(slow) against ``backend="eager"``; a generate() of N tokens compiles FlexAttention once (the
prompt), not N times.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import make_model, patch, token_ids
from encoding_cases import BLOCK_CASES, case_ids

import hf_posenc
import hf_posenc.attention.flex as flex
import hf_posenc.attention.flex_kernels as flex_kernels
from hf_posenc.attention.flex_kernels import KERNEL_LADDER, attend_with_ladder

OUT_OF_RESOURCE = "out of resource: shared memory, Required: 245760, Hardware limit: 232448"


@pytest.fixture(autouse=True)
def fresh_choices():
    flex_kernels.forget_kernel_choices()
    yield
    flex_kernels.forget_kernel_choices()


def _reference_attention(q, k, v):
    """Causal softmax attention written out: (B, H, T, D) -> (B, H, T, D)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(OUT_OF_RESOURCE)


def _attempt_failing_on(rungs_that_fail: set[str], in_backward: bool = False):
    """An ``attempt(q, k, v, options)`` that raises out-of-resource for the named rungs (in the
    forward, or only when its backward runs), and records the rungs it was called with."""
    names = {id(options): name for name, options in KERNEL_LADDER}
    calls: list[str] = []

    def attempt(q, k, v, options=None):
        name = names[id(options)]
        calls.append(name)
        out = _reference_attention(q, k, v)
        if name in rungs_that_fail:
            if not in_backward:
                raise RuntimeError(OUT_OF_RESOURCE)
            out = _FailsInBackward.apply(out)
        return out

    return attempt, calls


def _qkv(requires_grad: bool, dtype=torch.float32, width: int = 8):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, 2, 6, width, generator=generator, dtype=dtype).requires_grad_(requires_grad)
        for _ in range(3)
    ]


def test_an_out_of_resource_first_rung_climbs_to_the_next_and_the_choice_is_kept():
    attempt, calls = _attempt_failing_on({"default"})
    used: dict[str, str] = {}
    q, k, v = _qkv(requires_grad=False)
    with torch.no_grad():
        out = attend_with_ladder(attempt, q, k, v, used=used)
        torch.testing.assert_close(out, _reference_attention(q, k, v))
        assert calls == ["default", "tiles-64"]
        attend_with_ladder(attempt, q, k, v, used=used)  # the kept rung is asked first
    assert calls == ["default", "tiles-64", "tiles-64"]
    assert used == {
        "cpu/float32/d8/bias/forward": f"flex (tiles-64; default failed: RuntimeError: {OUT_OF_RESOURCE})"
    }
    assert flex_kernels.kernel_choices() == {"cpu/float32/d8/bias/forward": "tiles-64"}


def test_a_backward_that_runs_out_of_resource_is_caught_by_the_probe_before_any_loss_meets_it():
    attempt, calls = _attempt_failing_on({"default"}, in_backward=True)
    weight = torch.nn.Parameter(torch.ones(()))
    q, k, v = (t * weight for t in _qkv(requires_grad=False))
    out = attend_with_ladder(attempt, q, k, v)
    assert calls == ["default", "tiles-64", "tiles-64"]  # probe of rung 0 fails; rung 1 probed, then used
    assert weight.grad is None  # the probe differentiates detached copies only
    out.sum().backward()  # the real backward runs on the rung that built
    assert weight.grad is not None
    assert flex_kernels.kernel_choices() == {"cpu/float32/d8/bias/forward+backward": "tiles-64"}


def test_a_training_call_inside_a_recomputed_step_probes_its_backward_and_keeps_the_first_rung():
    """A recomputed step (FoX's token shift: core/recompute.py) runs its forward under hooks that
    refuse to unpack saved tensors; the ladder's probe must still build and run its backward
    there, so the first rung serves and the kind is not sent to the chunked backend. Gradients
    through the recomputed call equal those of the written-out attention."""
    from hf_posenc.core.recompute import recomputed

    attempt, calls = _attempt_failing_on(set())
    q, k, v = _qkv(requires_grad=True)
    used: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not build a kernel" warning
        out = recomputed(lambda q, k, v: attend_with_ladder(attempt, q, k, v, used=used), q, k, v)
    assert used == {"cpu/float32/d8/bias/forward+backward": "flex (default)"}
    out.square().sum().backward()
    expected = [t.detach().requires_grad_() for t in _qkv(requires_grad=True)]
    _reference_attention(*expected).square().sum().backward()
    for got, reference in zip((q, k, v), expected, strict=True):
        torch.testing.assert_close(got.grad, reference.grad)
    assert flex_kernels.kernel_choices() == {"cpu/float32/d8/bias/forward+backward": "default"}


def test_only_the_kind_whose_every_rung_failed_falls_back_with_one_warning():
    every = {name for name, _ in KERNEL_LADDER}
    attempt, calls = _attempt_failing_on(every)
    used: dict[str, str] = {}
    with torch.no_grad():
        with pytest.warns(
            RuntimeWarning, match="cpu/float32/d8/bias/forward .*tried default, tiles-64, tiles-32"
        ):
            assert attend_with_ladder(attempt, *_qkv(False), used=used) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning, no second round of builds
            assert attend_with_ladder(attempt, *_qkv(False), used=used) is None
        assert len(calls) == len(KERNEL_LADDER)
        healthy, _ = _attempt_failing_on(set())
        assert attend_with_ladder(healthy, *_qkv(False, width=16), used=used) is not None  # another kind
    assert used["cpu/float32/d8/bias/forward"].startswith(
        "chunked (tried default, tiles-64, tiles-32; last error"
    )
    assert used["cpu/float32/d16/bias/forward"] == "flex (default)"


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """FlexAttention as on CUDA (the compiled path with the ladder), compiled on CPU."""
    monkeypatch.setattr(flex, "COMPILE_OFF_CUDA", True)
    monkeypatch.setattr(flex, "FLEX_MIN_QUERIES", 16)
    build = flex._flex_function  # tests may replace it; the cached builder is cleared either way
    build.cache_clear()
    torch._dynamo.reset()
    yield
    build.cache_clear()
    torch._dynamo.reset()


def test_the_ladder_serves_a_model_and_patch_info_names_the_rung(monkeypatch, compiled_on_cpu):
    """A model whose FlexAttention build runs out of resource on the first rung still runs fused
    (on the second), equals eager, and says so in patch_info."""
    from torch.nn.attention.flex_attention import flex_attention

    def fake_compiled(q, k, v, *, kernel_options=None, **kwargs):
        if kernel_options is None:
            raise RuntimeError(OUT_OF_RESOURCE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, k, v, kernel_options=kernel_options, **kwargs)

    monkeypatch.setattr(flex, "_flex_function", lambda compiled: fake_compiled)
    models = {b: patch(make_model("llama"), "alibi", backend=b) for b in ("eager", "flex")}
    ids = token_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(models["flex"](ids).logits, models["eager"](ids).logits, atol=1e-5, rtol=0)
    assert hf_posenc.patch_info(models["flex"])["kernels"] == {
        "cpu/float32/d16/LinearDistanceBias/forward": f"flex (tiles-64; default failed: RuntimeError: {OUT_OF_RESOURCE})"
    }
    assert "kernels" not in hf_posenc.patch_info(models["eager"])


def test_uncompiled_flex_on_cpu_is_named_in_patch_info():
    """Off CUDA FlexAttention runs uncompiled (its exact reference path, not a kernel): patch_info
    (and so bench.json) says so for that kind of call, not nothing; a call FlexAttention does not
    take (training: no backward off CUDA) adds no entry, as chunked serves it."""
    model = patch(make_model("llama"), "alibi", backend="flex")
    with torch.no_grad():
        model(token_ids(2, 20))
    assert hf_posenc.patch_info(model)["kernels"] == {
        "cpu/float32/d16/LinearDistanceBias/forward": "flex (uncompiled)"
    }
    model(token_ids(2, 20)).logits.sum().backward()
    assert list(hf_posenc.patch_info(model)["kernels"]) == ["cpu/float32/d16/LinearDistanceBias/forward"]


def test_decoding_steps_never_reach_flex(monkeypatch, compiled_on_cpu):
    """Prompt (>= FLEX_MIN_QUERIES queries) through FlexAttention; each decoding step (one query)
    through chunked: no per-token shape is ever handed to the compiler."""
    seen: list[int] = []
    original = flex.attend_with_ladder

    def counting(attempt, q, k, v, **kwargs):
        seen.append(q.shape[-2])
        return original(attempt, q, k, v, **kwargs)

    monkeypatch.setattr(flex, "attend_with_ladder", counting)
    monkeypatch.setattr(flex, "_flex_function", lambda compiled: _uncompiled_flex)
    model = patch(make_model("llama"), "alibi", backend="flex")
    prompt = token_ids(1, 20)
    model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert seen == [flex.bucket_length(20)] * 2  # the prompt (at its length bucket), once per layer


def _uncompiled_flex(q, k, v, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_ids(BLOCK_CASES))
def test_compiled_flex_forward_equals_eager_for_every_bias_form(case, compiled_on_cpu):
    """torch.compile(flex_attention) on CPU, each bias form's score_mod inside the compiled kernel:
    logits equal backend="eager" (fp32, 1e-5 and 1e-4 relative — the CPU kernel sums in another
    order, over up to 128 keys), at three
    lengths of one length bucket (32, 20 and 128 tokens, all run at 128: the last one unpadded),
    compiled once (torch's compile counter does not move after the first length)."""
    from torch._dynamo.utils import counters

    name, params = case
    models = {b: patch(make_model("llama"), name, params, backend=b) for b in ("eager", "flex")}
    models["flex"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    assert flex.bucket_length(32) == flex.bucket_length(20) == flex.bucket_length(128) == 128
    counters.clear()
    for length in (32, 20, 128):
        ids = token_ids(1, length, seed=length)
        with torch.no_grad():
            reference = models["eager"](ids).logits
            logits = models["flex"](ids).logits
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-4)
        if length == 32:
            graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    kernels = hf_posenc.patch_info(models["flex"]).get("kernels", {})
    assert list(kernels.values()) == ["flex (default)"], kernels


@pytest.mark.slow
def test_padding_masks_and_cached_key_offsets_inside_a_bucket_compile_once(compiled_on_cpu):
    """Left-padded batches with cached keys (T5's distance table read at |i + offset - j|): a
    prefill and a cached chunk at two different prompt lengths — four (query, key, offset)
    shapes inside one length bucket — equal eager (fp32, 1e-5) from one compiled graph."""
    from torch._dynamo.utils import counters

    from hf_posenc.compat import cache_keyword, output_cache

    params = {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}
    models = {b: patch(make_model("llama"), "t5", params, backend=b) for b in ("eager", "flex")}
    models["flex"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    counters.clear()
    graphs = None
    for prompt, chunk in ((20, 17), (24, 18)):  # offsets 0, 20, 0, 24; keys up to 42: bucket 128
        ids = token_ids(2, prompt + chunk, seed=prompt)
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :3] = 0  # row 1 left-padded
        logits = {}
        for backend, model in models.items():
            with torch.no_grad():
                first = model(ids[:, :prompt], attention_mask=attention_mask[:, :prompt], use_cache=True)
                cache = {cache_keyword(model): output_cache(first)}
                second = model(ids[:, prompt:], attention_mask=attention_mask, use_cache=True, **cache)
            logits[backend] = torch.cat([first.logits, second.logits], dim=1)
        torch.testing.assert_close(logits["flex"][0], logits["eager"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits["flex"][1, 3:], logits["eager"][1, 3:], atol=1e-5, rtol=0)
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert list(hf_posenc.patch_info(models["flex"])["kernels"].values()) == ["flex (default)"]


@pytest.mark.slow
def test_dynamic_shapes_compile_once_for_every_length(monkeypatch, compiled_on_cpu):
    """``FLEX_DYNAMIC``: torch.compile(flex_attention, dynamic=True) at each call's own lengths (no
    buckets): T5's table-reading score_mod at 20, 32 and 60 tokens (three shapes) equals eager
    (fp32, 1e-5) from one compiled graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(flex, "FLEX_DYNAMIC", True)
    params = {"shared_across_layers": False, "num_buckets": 8, "max_distance": 12}
    models = {b: patch(make_model("llama"), "t5", params, backend=b) for b in ("eager", "flex")}
    models["flex"].posenc.load_state_dict(models["eager"].posenc.state_dict())
    counters.clear()
    for length in (20, 32, 60):
        ids = token_ids(1, length, seed=length)
        with torch.no_grad():
            torch.testing.assert_close(
                models["flex"](ids).logits, models["eager"](ids).logits, atol=1e-5, rtol=0
            )
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.slow
def test_generate_compiles_flex_for_the_prompt_not_for_every_token(compiled_on_cpu):
    """A generate() of 8 tokens after a 32-token prompt: the compiled FlexAttention function is
    built for the prompt's shape only (torch's compile counter), and the tokens equal eager's."""
    from torch._dynamo.utils import counters

    models = {b: patch(make_model("llama"), "alibi", backend=b) for b in ("eager", "flex")}
    prompt = token_ids(1, 32)
    counters.clear()
    tokens = models["flex"].generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    frames = counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 2, dict(counters["stats"])  # the prompt's graph (at most once more for a guard)
    reference = models["eager"].generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, reference)


def test_flashattention4_is_tried_first_only_where_no_backward_is_needed(monkeypatch):
    """With the FlashAttention-4 package present, a CUDA call that needs no backward asks for
    FlexAttention's FLASH backend first and climbs to the tiles when it fails to build; a call
    that needs a backward never asks for it (its template has no captured-tensor gradients)."""
    monkeypatch.setattr(flex_kernels, "flash4_available", lambda: True)
    forward = flex_kernels.KernelClass("cuda:0", "bfloat16", 64, 64, "DistanceBias", backward=False)
    training = dataclasses.replace(forward, backward=True)
    on_cpu = dataclasses.replace(forward, device="cpu")
    assert [name for name, _ in flex_kernels.ladder(forward)] == ["flash", "default", "tiles-64", "tiles-32"]
    assert flex_kernels.ladder(forward)[0][1] == {"BACKEND": "FLASH"}
    assert flex_kernels.ladder(training) == KERNEL_LADDER
    assert flex_kernels.ladder(on_cpu) == KERNEL_LADDER
    monkeypatch.setattr(flex_kernels, "flash4_available", lambda: False)
    assert flex_kernels.ladder(forward) == KERNEL_LADDER


def test_what_flex_keeps_across_calls_is_never_an_inference_tensor():
    """The bucketed layout's offset and key count and the causal block mask, made inside
    torch.inference_mode, are normal tensors: they are kept for later calls, and a later training
    step's FlexAttention saves them for backward (which an inference tensor refuses)."""
    flex._bucketed_layout.cache_clear()  # made here, not by an earlier test
    flex._BLOCK_MASKS.clear()
    with torch.inference_mode():
        layout = flex._layout(300, 300, torch.device("cpu"), True)
        block_mask = flex._causal_block_mask(layout, torch.device("cpu"))
    assert not layout.offset.is_inference() and not layout.keys.is_inference()
    assert not block_mask.kv_num_blocks.is_inference() and not block_mask.kv_indices.is_inference()
