"""The chunked backend's gradient of a learned bias (issue 21.6): SDPA's fused forward and a
backward that recomputes one block's weights (``BiasedBlockAttention``) instead of SDPA's math
path keeping every block's weights. Checked against autograd of softmax(q k^T s + bias) v
written out in fp64, and, through whole patched models, against the eager backend's gradients.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.attention import bias_block, chunked, toeplitz


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 9),
    extra=st.integers(0, 7),
    heads=st.integers(1, 3),
    batch=st.integers(1, 2),
    shared_bias=st.booleans(),
    seed=st.integers(0, 2**16),
    reverse=st.booleans(),
)
def test_block_attention_gradients_equal_autograd_of_the_formula(
    rows, extra, heads, batch, shared_bias, seed, reverse
):
    """Output and gradients of q, k, v and the bias (broadcast over the batch or not) equal
    autograd through softmax(q k^T * s + bias) v in fp64, fp32 within 1e-5; with ``reverse``
    (the Toeplitz path's key order) the keys and values attended are k and v flipped along the keys."""
    generator = torch.Generator().manual_seed(seed)
    keys = rows + extra
    q, k, v = (torch.randn(batch, heads, n, 4, generator=generator) for n in (rows, keys, keys))
    bias = torch.randn(1 if shared_bias else batch, heads, rows, keys, generator=generator)
    bias[..., -1] = torch.finfo(torch.float32).min  # a masked key, as the causal fold writes it
    grad = torch.randn(batch, heads, rows, 4, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = bias_block.BiasedBlockAttention.apply(*leaves, 0.7, reverse)
    (out * grad).sum().backward()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, bias)]
    q64, k64, v64, b64 = leaves64
    keys, values = (k64.flip(-2), v64.flip(-2)) if reverse else (k64, v64)
    want = torch.softmax(q64 @ keys.transpose(-1, -2) * 0.7 + b64, dim=-1) @ values
    (want * grad.double()).sum().backward()
    torch.testing.assert_close(out.double(), want.detach(), atol=1e-5, rtol=1e-5)
    for got, ref in zip(leaves, leaves64, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "params", "path"),
    [
        ("t5", {}, "toeplitz"),
        ("kerple", {}, "toeplitz"),
        ("fire", {}, "toeplitz"),  # every query below L: a Toeplitz table
        # past L: blocks rebuilt in backward, on CPU in fp32 on the fused kernel with its lse kept
        ("fire", {"init_L": 6.0}, "rebuilt_flash"),
        ("fox", {}, "separable"),
    ],
    ids=lambda v: str(v),
)
def test_learned_bias_training_uses_a_fused_backward_and_equals_eager(name, params, path, monkeypatch):
    """Training a learned-bias encoding on the chunked backend never sends SDPA a float mask
    that needs its gradient: a Toeplitz table goes through ToeplitzAttention (reversed queries,
    one function over all its blocks), a bias written
    out per block is rebuilt in backward from its form's tensors (no second SDPA forward; on CPU
    in fp32 without padding RebuiltBiasFlashAttention, the fused kernel's lse kept, else
    RebuiltBiasAttention), a separable one (FoX) rides in q and k (attend_separable, SDPA's own
    backward); every parameter's gradient equals the eager backend's (fp32, 1e-5)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 8)
    calls = {"toeplitz": 0, "recompute": 0, "separable": 0, "rebuilt": 0, "rebuilt_flash": 0}
    originals = {
        "toeplitz": toeplitz.ToeplitzAttention.apply,
        "recompute": bias_block.BiasedBlockAttention.apply,
        "separable": chunked.attend_separable,
        "rebuilt": bias_block.RebuiltBiasAttention.apply,
        "rebuilt_flash": chunked.RebuiltBiasFlashAttention.apply,
    }

    def counting(kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            return originals[kind](*args, **kwargs)

        return call

    monkeypatch.setattr(toeplitz.ToeplitzAttention, "apply", counting("toeplitz"))
    monkeypatch.setattr(bias_block.BiasedBlockAttention, "apply", counting("recompute"))
    monkeypatch.setattr(chunked, "attend_separable", counting("separable"))
    monkeypatch.setattr(bias_block.RebuiltBiasAttention, "apply", counting("rebuilt"))
    monkeypatch.setattr(chunked.RebuiltBiasFlashAttention, "apply", counting("rebuilt_flash"))
    ids = token_ids(2, 40)
    grads = {}
    for backend in ("chunked", "eager"):
        model = patch(make_model("llama"), name, params, backend=backend)
        model.train()
        model(ids, labels=ids).loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert calls[path], f"the chunked backend did not take its {path} path"
    if path == "separable":
        assert not calls["recompute"] and not calls["toeplitz"], "a separable bias was written out"
    if path == "toeplitz":
        assert not calls["recompute"] and not calls["rebuilt"], "a Toeplitz block was written out"
    assert grads["chunked"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["chunked"][n], g, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize(
    ("frozen", "checkpointed"),
    [(False, False), (True, False), (False, True)],
    ids=["whole-model", "encoding-only", "gradient-checkpointing"],
)
def test_fire_training_past_its_threshold_collects_the_reversed_keys_gradients(
    frozen, checkpointed, monkeypatch
):
    """FIRE's blocks past L attend views of one reversed copy of the layer's k and v and add their
    gradients into one sum per layer (``ReversedGradients``) that the copy's backward flips back:
    with the whole model trained, the gradients of every weight (those reached through k and v
    included) equal the eager backend's; with only the encoding trained (the first layer's k and v
    need no gradient: nothing collected there), FIRE's gradients do too; with the chunked model's
    layers recomputed in backward (gradient checkpointing) as well (fp32, 1e-5)."""
    monkeypatch.setattr(chunked, "QUERY_BLOCK", 8)
    added = []
    original_add = chunked.ReversedGradients.add

    def counting_add(self, grad_k, grad_v):
        added.append(grad_k.shape[2])
        return original_add(self, grad_k, grad_v)

    monkeypatch.setattr(chunked.ReversedGradients, "add", counting_add)
    ids = token_ids(2, 40)
    grads = {}
    for backend in ("chunked", "eager"):
        model = patch(make_model("llama"), "fire", {"init_L": 6.0}, backend=backend)
        model.train()
        if checkpointed and backend == "chunked":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if frozen:
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(name.startswith("posenc."))
        model(ids, labels=ids).loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"], "no parameter got a gradient"
    # the blocks past L (ending at 16, 24, 32, 40 keys) of every layer whose k and v need a gradient:
    # with only FIRE trained, every layer but the first (its input needs none; later layers' inputs
    # carry the earlier layers' FIRE)
    layers = model.config.num_hidden_layers
    assert sorted(added) == sorted(list(range(16, 41, 8)) * (layers - frozen)), added
    assert grads["chunked"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["chunked"][n], g, atol=1e-5, rtol=1e-5, msg=n)


def _saved_bytes(length: int, block: int, mask: bool) -> int:
    """Bytes autograd keeps for backward over one separable-bias call (FoX's form) with gradients."""
    from hf_posenc.encodings.block_bias import SeparableBias

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 8, generator=generator).requires_grad_() for _ in range(3))
    terms = torch.randn(1, 2, length, generator=generator).cumsum(-1).requires_grad_()
    bias = SeparableBias(length, length, terms, terms)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None] if mask else None
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = chunked.attend_chunked(q, k, v, bias=bias, mask=causal, softmax_scale=0.3, block=block)
    out.sum().backward()  # the kept tensors serve a real backward
    return sum(saved)


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "padding-mask"])
def test_separable_bias_training_keeps_memory_linear_in_length(mask):
    """With gradients the separable path (FoX on the chunked backend) keeps no per-block keys or
    masks for backward (each block is recomputed): what autograd saves at 4x the length, in
    blocks of 8 queries, is at most 4x (linear), not the ~16x of keeping every block's keys."""
    short, long = _saved_bytes(64, 8, mask), _saved_bytes(256, 8, mask)
    assert long <= 4 * short + 4096, (short, long)
