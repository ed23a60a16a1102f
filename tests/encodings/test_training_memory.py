"""Issue 22.2: what a training step keeps for backward per token beyond the same model with RoPE,
bounded by what each encoding's formula needs (counted from its shapes), and the gradients of
the leaner graph equal those of plain autograd on the eager backend (fp32, 1e-5).

Measured as the growth of the distinct storages autograd saves from T to 2T tokens, so
per-layer constants cancel; RoPE's own graph is the baseline (what native attention keeps)."""

from __future__ import annotations

import copy

import pytest
import torch
from capture import peak_allocated_bytes, saved_storages
from conftest import make_model, patch, token_ids

import hf_posenc.attention.backend as backend_module
import hf_posenc.attention.chunked as chunked
import hf_posenc.attention.forward as forward_module
import hf_posenc.attention.stream_flash as stream_flash
import hf_posenc.encodings.fox_pro as fox_pro_module
import hf_posenc.encodings.tape as tape_module

SHORT, LONG = 32, 64
FP32 = 4


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one training forward."""
    with saved_storages() as storages:
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()  # the kept tensors serve a real backward
    return sum(storages.values())


def _growth_beyond_rope(model: torch.nn.Module, name: str, params: dict | None = None) -> float:
    """Saved bytes per token of ``name`` minus RoPE's, from the growth between SHORT and LONG."""
    patched = patch(copy.deepcopy(model), name, params).train()
    rope = patch(copy.deepcopy(model), "rope", randomize=False).train()
    short, long = token_ids(1, SHORT), token_ids(1, LONG)
    grown = _saved_bytes(patched, long) - _saved_bytes(patched, short)
    baseline = _saved_bytes(rope, long) - _saved_bytes(rope, short)
    return (grown - baseline) / (LONG - SHORT)


def _geometry(model: torch.nn.Module) -> tuple[int, int, int, int]:
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return config.num_hidden_layers, heads, kv_heads, config.hidden_size // heads


def test_xpos_keeps_its_scaled_tables_once_per_forward():
    """xPos rotates q and k by RoPE's cos/sin times zeta^(+-n/gamma): four (T, d_rot) tables
    where RoPE has two. Per token that is 2 d_rot fp32 values beyond RoPE for the whole forward
    (the tables are shared by every layer), not a converted copy of the four per layer."""
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3
    )
    _, _, _, d = _geometry(model)
    assert _growth_beyond_rope(model, "xpos") <= 2 * d * FP32


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_tape_keeps_what_its_formula_needs(kv_heads):
    """TAPE per token and layer beyond RoPE: the stream E^l, E^{l+1/2} and the attended stream
    (sum_j a_tj E_j, for gamma's gradient), Hkv*D each, the PE layer's gate input and output (P
    each), and the output projection's input (Hq*D, a copy: the attention's output also holds
    the attended stream). Its unrotated q and k stand where RoPE keeps its rotated ones (the
    rotation is rebuilt in the attention's backward). Not the padded q, k, values and output of
    the fused attention (2D wide), nor the rotated q and k beside the unrotated ones, nor the
    rotation's or the PE layer's (B, P, T, D) intermediates."""
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=3
    )
    layers, heads, kv, d = _geometry(model)
    size = 4 * kv  # P, TAPE's default position_size
    per_layer = 3 * kv * d + 2 * size + heads * d
    assert _growth_beyond_rope(model, "tape") <= layers * per_layer * FP32


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_fox_pro_keeps_what_its_formula_needs(kv_heads):
    """FoX (Pro) per token and layer beyond RoPE: the output gate's logits and the gated output
    (the output projection's input, Hq*D each), the shift weights a_t (Hkv each for k and v) and
    FoX's forget-gate pieces (a few Hq). Its raw q, k and v (the QK-norm's and the token shift's
    gradients need them) stand where RoPE keeps its rotated ones: the shifted and normalised
    q, k, v are rebuilt from them in backward (on CPU before the fused kernels' backward,
    elsewhere for the attention recomputed). Not the shifted, normalised, sigmoid and gated
    copies, nor the attention's q, k, v beside the raw ones."""
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=3
    )
    layers, heads, kv, d = _geometry(model)
    per_layer = 2 * heads * d + 2 * kv + 4 * heads
    assert _growth_beyond_rope(model, "fox_pro") <= layers * per_layer * FP32


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_fire_on_the_chunked_backend_keeps_no_reversed_keys(kv_heads, monkeypatch):
    """FIRE on the chunked backend, queries below L in Toeplitz blocks (keys reversed) and past
    it in rebuilt blocks, per token and layer beyond RoPE: the blocks' outputs, kept by each
    block and again concatenated for the output projection (Hq*D), FIRE's per-token pieces (a
    few Hq and scalars). Not reversed copies of k and v beside the originals (with grouped keys:
    beside the per-query-head copies, which RoPE's attention keeps too)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 8)
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=3
    )
    layers, heads, kv, d = _geometry(model)
    per_layer = heads * d + 8 * heads
    growth = _growth_beyond_rope(model, "fire", {"init_L": 24.0})
    assert growth <= layers * per_layer * FP32


def _peak_growth_beyond_rope(model: torch.nn.Module, name: str) -> float:
    """Peak allocated bytes of a training step per token of ``name`` minus RoPE's, from the
    growth between 64 and 128 tokens (the allocator's events: independent of load)."""
    short, long = token_ids(1, 64), token_ids(1, 128)

    def growth(patched: torch.nn.Module) -> int:
        def step(ids: torch.Tensor):
            return lambda: patched(ids, labels=ids, use_cache=False).loss.backward()

        return peak_allocated_bytes(step(long)) - peak_allocated_bytes(step(short))

    patched = patch(copy.deepcopy(model), name).train()
    rope = patch(copy.deepcopy(model), "rope", randomize=False).train()
    return (growth(patched) - growth(rope)) / 64


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["tape", "fox_pro"])
def test_peak_memory_of_a_step_is_what_is_kept_and_one_layer_at_work(name, kv_heads):
    """The peak of what a training step holds at once, per token beyond RoPE, is at most what
    the formula keeps for backward (the bounds above) plus one layer's attention recomputed
    and run backward at twice the head width (TAPE's fused values and stream: padded q, k, the
    widened values, output and their gradients; 16 (Hq, D) per token). It is not what the
    recomputed steps' own forward graphs held until Python's cyclic collector ran (they saved
    their outputs: a reference cycle), nor the rotated or normalised q, k, v that a recomputed
    attention's closure kept until backward, nor the layers' input streams the memo kept, nor
    TAPE's (B, P, T, D) PE-layer products rebuilt once per chained input: measured on the code
    before, 23 KiB (TAPE) and 10 KiB (FoX-Pro) per token beyond RoPE here, against bounds of 7.4
    and 5.8."""
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=3
    )
    layers, heads, kv, d = _geometry(model)
    # the bounds of the saved-state tests above: TAPE's (P = 4 Hkv) and FoX-Pro's
    kept = {"tape": 3 * kv * d + 2 * 4 * kv + heads * d, "fox_pro": 2 * heads * d + 2 * kv + 4 * heads}
    per_layer = kept[name]
    assert _peak_growth_beyond_rope(model, name) <= (layers * per_layer + 16 * heads * d) * FP32


def _gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["tape", "fox_pro"])
def test_gradients_equal_plain_autograd_on_eager(name, kv_heads, monkeypatch):
    """The recomputed steps (TAPE's rotation, PE layer and fused stream attention; FoX (Pro)'s
    token shift, QK-norm, attention, output norm and gate) give the gradients plain autograd through the
    eager backend gives (nothing recomputed)."""
    model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads).train()
    ids = token_ids(2, 24)
    lean = patch(copy.deepcopy(model), name)
    got = _gradients(lean, ids)
    plain = patch(copy.deepcopy(model), name, backend="eager")
    for module in (tape_module, fox_pro_module, backend_module):
        monkeypatch.setattr(module, "recomputed", lambda function, *inputs: function(*inputs))
    want = _gradients(plain, ids)
    assert got.keys() == want.keys()
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("name", ["tape", "fox_pro"])
def test_gradient_checkpointing_runs_each_attention_at_most_twice(name, monkeypatch):
    """Under gradient checkpointing (non-reentrant: the decoder layer runs again in backward)
    the encoding's recomputed steps are plain calls, so a training step runs each layer's
    attention forward twice (forward, then the checkpoint's recomputation), not three times;
    without checkpointing once on CPU: the fused kernels' backward takes the forward's
    statistics and rebuilds only the recomputed steps' q, k, v (TAPE: ``attention/stream_flash.py``,
    FoX (Pro): ``attention/separable.py``; before, FoX (Pro)'s attention ran again in backward).
    Gradients equal the step without checkpointing (fp32, 1e-5)."""
    model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2).train()
    ids = token_ids(2, 24)
    plain = patch(copy.deepcopy(model), name)
    checkpointed = patch(copy.deepcopy(model), name)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    calls: list[int] = []
    dispatch, stream_forward = backend_module.dispatch, stream_flash._forward

    def counted(call):
        calls.append(1)
        return dispatch(call)

    def counted_stream(*args, **kwargs):
        calls.append(1)
        return stream_forward(*args, **kwargs)

    for module in (backend_module, forward_module):  # every caller of the dispatcher
        monkeypatch.setattr(module, "dispatch", counted)
    monkeypatch.setattr(stream_flash, "_forward", counted_stream)
    layers = model.config.num_hidden_layers
    expected = (layers, 2 * layers)
    grads = []
    for patched, count in zip((plain, checkpointed), expected, strict=True):
        calls.clear()
        grads.append(_gradients(patched, ids))
        assert len(calls) == count
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["kerple", "alibi"])
def test_toeplitz_tables_keep_no_more_than_rope(name, kv_heads):
    """A distance table on the chunked backend's Toeplitz path (learned: kerple; fixed: alibi)
    keeps per token and layer what RoPE's attention keeps (q, k, v, the output, the log-sum-exp)
    and at most a few Hq values more (the table's own pieces): the output is laid out as the
    output projection reads it, so that projection keeps a view of it, not a copy (with grouped
    keys both keep the per-query-head copies of k and v)."""
    model = make_model(
        "llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=3
    )
    layers, heads, _, _ = _geometry(model)
    assert _growth_beyond_rope(model, name) <= layers * 4 * heads * FP32


def test_tape_inference_peak_does_not_grow_with_depth():
    """Without gradients each layer's E^{l+1/2} is dropped once the next layer has read it: the peak
    of a forward per token beyond RoPE is the same with 3 and 7 layers (it held every layer's
    stream until the forward ended: Hkv * D floats per token more for each layer). (Not 2: a
    2-layer model's one stream layer reads the initial stream, whose peak is lower.)"""

    def beyond_rope(layers: int) -> float:
        model = make_model("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=layers)

        def growth(patched: torch.nn.Module) -> int:
            def forward(ids: torch.Tensor):
                def run():
                    with torch.no_grad():
                        patched(ids, use_cache=False)

                return run

            return peak_allocated_bytes(forward(token_ids(1, 256))) - peak_allocated_bytes(
                forward(token_ids(1, 128))
            )

        tape = patch(copy.deepcopy(model), "tape")
        rope = patch(copy.deepcopy(model), "rope", randomize=False)
        return (growth(tape) - growth(rope)) / 128

    shallow, deep = beyond_rope(3), beyond_rope(7)
    assert deep - shallow <= 64, (shallow, deep)
