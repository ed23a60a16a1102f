"""Invariants every encoding keeps on every family: KV-cache decoding, left padding,
save/reload, exact unpatch, training, gradient checkpointing, bf16, backends.

The cases are every registered encoding's (tests/encoding_cases.py); test_suite_coverage.py
checks that the registry covers every encoding hf_posenc registers.
"""

from __future__ import annotations

import pytest
import torch
from capture import LENGTH, run_and_capture
from conftest import (
    ENCODING_FILE_FAMILIES,
    FAMILIES,
    ROTARY_FAMILIES,
    make_model,
    patch,
    token_ids,
)
from encoding_cases import (
    ALL_CASES,
    CASES_BY_ENCODING,
    PARAMETER_FREE,
    Case,
    case_id,
    has_explicit_scores,
    serves,
)
from references import attention_outputs
from transformers import DynamicCache

import hf_posenc

ATOL = 1e-5
#: FoX (Pro)'s gates, shifts and norms run in float32 inside the model (the model's dtype does
#: not change that): a batch of two rows takes other fp32 kernel paths than one row, and the
#: padded row's cumulative log-forget sums carry the padding's terms (c[i] - c[j] cancels them).
#: Measured on the llama/mistral/smollm3 test models: up to 1.9e-5 (logits up to 3.7); the same
#: sequence twice in one batch already differs from it alone by 2.3e-6. A padding leak would be
#: of the order of the logits.
PADDED_BATCH_ATOL = {"fox_pro": 5e-5}
#: CAPE mixes each score's heads through its MLP in fp32 from fp32 scores, so the few-query
#: path of a decoding step and the full forward's blocks round differently, and the MLP carries
#: the difference: on the test models (2026-11-27) decoding against the full forward read
#: 3.3e-6 to 1.07e-5 for CAPE's cases (logits up to 7.9; kerple's power base the most), 2.4e-6
#: to 6.0e-6 for alibi, kerple and FIRE alone. Rounding only: with the scores and the mixer in
#: fp64 the two agree to 1.8e-15 on mistral, llama and smollm3 for every CAPE case. A wrong
#: cached key or bias would differ by the order of the logits.
DECODE_ATOL = {"cape": 3e-5}
#: the two full-attention backends compared by test_eager_backend_equals_sdpa_backend (the block
#: backends chunked, flex and auto are compared with eager in test_backends.py)
FULL_BACKENDS = ("sdpa", "eager")
#: the cases whose sdpa backend runs a core of its own (see test_eager_backend_equals_sdpa_backend)
SDPA_CASES = [case for case in ALL_CASES if not has_explicit_scores(case)]


def family_case_params(cases: list[Case]) -> list:
    """Every family x case (the other families: each encoding's first case). The default run (``-m "not slow"``) keeps one of them per encoding:
    its first case, on a family that rotates from encoding to encoding so every family is
    exercised; the rest is marked ``slow`` (CI runs all)."""
    encodings = list(dict.fromkeys(name for name, _ in cases))
    first_of = {name: next(c for c in cases if c[0] == name) for name in encodings}
    quick = []
    for i, name in enumerate(encodings):
        takers = [f for f in FAMILIES if serves(f in ROTARY_FAMILIES, first_of[name])]
        quick.append((takers[i % len(takers)], first_of[name]))
    first_cases = [next(c for c in cases if c[0] == name) for name in encodings]
    return [
        pytest.param(
            family,
            case,
            id=f"{family}-{case_id(case)}",
            marks=() if any(q == (family, case) for q in quick) else pytest.mark.slow,
        )
        for family in FAMILIES
        # the variants exercise encoding code, not family code: they run on the families of the
        # encoding-specific files; every other family runs each encoding's first case
        for case in (cases if family in ENCODING_FILE_FAMILIES else first_cases)
        if serves(family in ROTARY_FAMILIES, case)
    ]


#: every registered case of every encoding on every family (overrides conftest's fixtures)
EVERY_FAMILY_AND_CASE = pytest.mark.parametrize(("family", "case"), family_case_params(ALL_CASES))


@EVERY_FAMILY_AND_CASE
def test_cached_decoding_equals_full_forward(family, case):
    """Token-by-token decoding with a KV cache gives, at every step, the logits a full
    forward over the same prefix gives for its last position."""
    name, params = case
    model = patch(make_model(family), name, params)
    ids = token_ids(2, 14)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :5], past_key_values=cache, use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(5, 14):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
        for i, t in enumerate(range(4, 14)):
            full = model(ids[:, : t + 1]).logits[:, -1]
            torch.testing.assert_close(steps[i], full, atol=DECODE_ATOL.get(name, ATOL), rtol=0)


@EVERY_FAMILY_AND_CASE
def test_generate_with_cache_equals_without(family, case):
    """Greedy and sampled generate() give the same tokens and logits with and without the KV cache."""
    name, params = case
    model = patch(make_model(family), name, params)
    prompt = token_ids(2, 6)
    outputs = {}
    for use_cache in (True, False):
        for sample in (False, True):
            torch.manual_seed(7)
            outputs[use_cache, sample] = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=6,
                do_sample=sample,
                use_cache=use_cache,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    for sample in (False, True):
        cached, uncached = outputs[True, sample], outputs[False, sample]
        assert torch.equal(cached.sequences, uncached.sequences)
        for a, b in zip(cached.logits, uncached.logits, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@EVERY_FAMILY_AND_CASE
def test_left_padded_batch_equals_each_sequence_alone(family, case):
    """Logits of real tokens in a left-padded batch equal those of each sequence run alone,
    in a plain forward and through generate()."""
    name, params = case
    model = patch(make_model(family), name, params)
    long, short = token_ids(1, 10, seed=1), token_ids(1, 6, seed=2)
    pad = torch.zeros(1, 4, dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], dim=1)])
    mask = torch.cat([torch.ones(1, 10), torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], dim=1)]).long()
    atol = PADDED_BATCH_ATOL.get(name, ATOL)
    with torch.no_grad():
        together = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(together[0], model(long).logits[0], atol=atol, rtol=0)
        torch.testing.assert_close(together[1, 4:], model(short).logits[0], atol=atol, rtol=0)
    # min_new_tokens: a random model may emit EOS at once; then the batch row goes on with padding
    # while the row alone stops, and the two could not be compared token by token
    generated = model.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    alone = model.generate(
        short,
        attention_mask=torch.ones_like(short),
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(generated.sequences[1, 10:], alone.sequences[0, 6:])
    for a, b in zip(generated.logits, alone.logits, strict=True):
        torch.testing.assert_close(a[1], b[0], atol=ATOL, rtol=0)


@EVERY_FAMILY_AND_CASE
def test_save_and_reload_gives_identical_logits(family, case, tmp_path):
    """save_pretrained -> hf_posenc.from_pretrained restores the encoding and its learned
    parameters: identical logits and identical encoding tensors."""
    name, params = case
    model = patch(make_model(family), name, params)
    ids = token_ids(2, 12)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    reloaded = hf_posenc.from_pretrained(str(tmp_path)).eval()
    assert hf_posenc.patch_info(reloaded) == hf_posenc.patch_info(model)
    for key, value in model.posenc.state_dict().items():
        assert torch.equal(reloaded.posenc.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, before)
    hf_posenc.unpatch_model(reloaded)  # the reloaded model can be restored to the original too
    with torch.no_grad():
        hf_posenc.unpatch_model(model)
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@EVERY_FAMILY_AND_CASE
def test_unpatch_restores_exactly_and_leaves_no_trace(family, case):
    name, params = case
    model = make_model(family)
    ids = token_ids(2, 12)
    base = model.base_model
    with torch.no_grad():
        before = model(ids).logits
    keys = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    hooks = (len(base._forward_pre_hooks), len(base._forward_hooks))
    config_keys = set(model.config.to_dict())

    patch(model, name, params)
    with torch.no_grad():
        model(ids)
    hf_posenc.unpatch_model(model)

    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == modules
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert model.config._attn_implementation == impl
    assert (len(base._forward_pre_hooks), len(base._forward_hooks)) == hooks
    assert set(model.config.to_dict()) == config_keys and not hasattr(model.config, "posenc")
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert hf_posenc.patch_info(model) is None


@EVERY_FAMILY_AND_CASE
def test_optimizer_step_trains_the_encoding(family, case):
    """One AdamW step on the language-model loss trains the model through the encoding.

    Every encoding: the loss is finite, gradients reach every trainable weight of the model
    (attention projections included) and the step changes every weight whose gradient is
    nonzero. An encoding with parameters: gradients reach each of them and the step changes
    each. A parameter-free encoding (``PARAMETER_FREE``; that it has none is checked here) has
    nothing of its own to train: after the step its attention layers still equal the formula
    reference computed from the updated weights (no stale cache of the old weights, no hidden
    trained state)."""
    name, params = case
    model = patch(make_model(family), name, params).train()
    assert bool(list(model.posenc.parameters())) == (name not in PARAMETER_FREE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = token_ids(2, 12)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for n, p in trainable.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    optimizer.step()
    for n, p in trainable.items():
        assert not torch.equal(p, before[n]), n
    if name in PARAMETER_FREE:
        records, attention = run_and_capture(model.eval(), token_ids(2, LENGTH))
        expected = attention_outputs(name, params, model, attention, records)
        for layer_idx, want in enumerate(expected):
            torch.testing.assert_close(records[layer_idx][1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [cases[0] for cases in CASES_BY_ENCODING.values()], ids=case_id)
def test_module_apply_visits_every_submodule(case):
    """``model.apply(fn)`` (what weight-initialisation helpers run) calls ``fn`` on every submodule
    of a patched model, the encoding module and its children included: no encoding shadows
    ``nn.Module.apply`` with a method of its own. Reference: torch's ``model.modules()``."""
    name, params = case
    model = patch(make_model("llama"), name, params)
    visited: list[torch.nn.Module] = []
    model.apply(visited.append)
    assert {id(m) for m in visited} == {id(m) for m in model.modules()}


@EVERY_FAMILY_AND_CASE
def test_gradient_checkpointing_gives_the_same_gradients(family, case):
    name, params = case
    reference = patch(make_model(family), name, params).train()
    checkpointed = patch(make_model(family), name, params).train()
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = token_ids(2, 12)
    for model in (reference, checkpointed):
        model(ids, labels=ids).loss.backward()
    for (n, a), (_, b) in zip(reference.named_parameters(), checkpointed.named_parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, n
        else:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


@EVERY_FAMILY_AND_CASE
def test_bf16_long_input_is_finite(family, case):
    """In bf16 at 4x a 12-token training length (48 tokens) the logits stay finite."""
    name, params = case
    model = patch(make_model(family), name, params).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(token_ids(2, 48)).logits
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("family", "case"), family_case_params(SDPA_CASES))
def test_eager_backend_equals_sdpa_backend(family, case):
    """The sdpa backend's logits equal the eager reference core's (explicit fp32 scores), with
    and without left padding.

    Left out: the cases of ``has_explicit_scores`` (cope, sba, cape and RoPE with causal dynamic
    NTK). Their attention needs explicit scores, so both backends run the same eager core and
    the comparison would be eager with itself; they are checked instead against their fp64
    formula references (tests/encodings/test_formula_references.py) and, in query
    blocks, against eager in test_backends.py."""
    name, params = case
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    logits = []
    for backend in FULL_BACKENDS:
        model = patch(make_model(family), name, params, backend=backend)
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(logits[0][0], logits[1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0][1, 3:], logits[1][1, 3:], atol=ATOL, rtol=0)
