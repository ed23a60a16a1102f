"""LieRE and ComRoPE rotate by exp(w S) of skew-symmetric blocks through each generator's
eigenbasis (hf_posenc/encodings/skew_rotation.py) instead of a matrix exponential per position
(issue 21.5). Checked here against ``torch.linalg.matrix_exp`` of generators assembled in fp64
from the encodings' raw parameters with the papers' formulas: the rotation for any skew block
and scalar (hypothesis), the encodings' rotated q and k and their gradients with respect to
every parameter (autograd through the reference, fp32 1e-5), and the fallback for generators
whose eigenvalues are not separated.
"""

from __future__ import annotations

import copy

import pytest
import torch
from capture import peak_allocated_bytes, saved_storages
from conftest import make_model, patch, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.core.memo import ForwardMemo
from hf_posenc.encodings import skew_rotation
from hf_posenc.encodings.base import probe_layer_call
from hf_posenc.encodings.skew_rotation import eigenbasis, rotate_blocks

SETTINGS = settings(max_examples=20, deadline=None)


@SETTINGS
@given(
    block=st.sampled_from([2, 4, 8]),
    scale=st.floats(1e-3, 3.0),
    seed=st.integers(0, 2**16),
    far=st.booleans(),
)
def test_eigenbasis_rotation_equals_the_matrix_exponential(block, scale, seed, far):
    """For random skew-symmetric S (heads x blocks) and scalars w (positions up to 4096 when
    ``far``), V rot(w mu) V^T x equals matrix_exp(w S) x computed in fp64, within fp32 rounding."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randn(2, 3, block, block, generator=generator, dtype=torch.float64) * scale
    skew = raw - raw.transpose(-1, -2)  # (H, m, b, b)
    decomposed = eigenbasis(skew)
    assert decomposed is not None  # random generators have distinct eigenvalues
    basis, mu = decomposed
    w = torch.rand(1, 1, 5, 3, generator=generator, dtype=torch.float64) * (4096.0 / scale if far else 8.0)
    x = torch.randn(1, 2, 5, 3, block, generator=generator, dtype=torch.float64)
    got = rotate_blocks(x, basis, w[..., None] * mu[None, :, None])  # (1, H, T, m, b)
    rotation = torch.linalg.matrix_exp(w[..., None, None] * skew[None, :, None])  # (1, H, T, m, b, b)
    want = (rotation @ x[..., None]).squeeze(-1)
    # exact in fp64 up to the rounding of the angle w * mu (relative 1e-16 of |w mu| <= 1e5)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_unseparated_eigenvalues_fall_back():
    """A block with a repeated frequency or a null one has no unique eigenbasis: None."""
    repeated = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    repeated[..., 0, 1], repeated[..., 2, 3] = 0.5, 0.5
    repeated = repeated - repeated.transpose(-1, -2)
    assert eigenbasis(repeated) is None
    assert eigenbasis(torch.zeros(1, 1, 2, 2)) is None


# -- the encodings against matrix_exp of their generators, assembled from the raw parameters ------


def liere_generator(raw: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """LieRE's (D, D) generator A = U - U^T of one head: raw (nb, b, b), strict upper triangle U
    per block; block n's index a is rotary pair (n b + a) // 2, member (n b + a) % 2 -> dim i or
    i + d_rot/2 (Llama's pair layout)."""
    upper = torch.triu(raw, diagonal=1)
    blocks = torch.block_diag(*(upper - upper.transpose(-1, -2)))  # (d_rot, d_rot), adjacent pairs
    index = torch.tensor([i // 2 + (i % 2) * (rotary // 2) for i in range(rotary)])
    out = raw.new_zeros(head_dim, head_dim)
    return out.index_put((index[:, None], index[None, :]), blocks)


def comrope_generator(raw: torch.Tensor, coefficients: torch.Tensor, x: torch.Tensor, head_dim: int):
    """ComRoPE's sum_a x_a A_a of one head: raw P (m, b, b), B_aj = c_aj (P_j - P_j^T) on the dims
    (j, j + m, .., j + (b-1) m); x (N,), coefficients c (N, m)."""
    m, b = raw.shape[0], raw.shape[-1]
    weight = x @ coefficients  # (m,)
    out = raw.new_zeros(head_dim, head_dim)
    for j in range(m):
        index = torch.arange(b) * m + j
        out = out.index_put(
            (index[:, None], index[None, :]), weight[j] * (raw[j] - raw[j].T), accumulate=True
        )
    return out


def rotated(name: str, posenc, layer: int, positions: torch.Tensor, q, k, params) -> tuple:
    """The reference's rotated q (fp64) and k: R_t = matrix_exp(A(t)) per token, per KV head."""
    d = q.shape[-1]
    groups = q.shape[1] // k.shape[1]
    outs = []
    for x, per_query in ((q, True), (k, False)):
        rows = []
        for h in range(x.shape[1]):
            g = h // groups if per_query else h
            per_token = []
            for t in range(x.shape[2]):
                p = float(positions[0, t])
                if name == "liere":
                    cfg = posenc.config
                    raw = params["generators"][0 if cfg.shared_across_layers else layer]
                    raw = raw[0 if cfg.shared_across_heads else g, 0]
                    generator = p * liere_generator(raw, d, posenc.dim)
                else:
                    coefficients = (
                        params["axis_scale"][layer] if "axis_scale" in params else posenc.axis_mask.double()
                    )
                    coords = torch.tensor([p] + [0.0] * (posenc.config.axes - 1), dtype=torch.float64)
                    generator = comrope_generator(params["generator"][layer, g], coefficients, coords, d)
                per_token.append(torch.linalg.matrix_exp(generator) @ x[0, h, t].double())
            rows.append(torch.stack(per_token))
        outs.append(torch.stack(rows)[None])
    return outs


def _perturbed(name: str, params: dict, seed: int):
    """A patched tiny Llama whose encoding parameters are moved off their initial values (random
    steps of 0.3), with the generator that drew them (for the test's own inputs)."""
    model = patch(make_model("llama"), name, params, randomize=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.posenc.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    return model, generator


ENCODINGS = [
    ("liere", {}),
    ("liere", {"shared_across_heads": True, "block_size": 4}),
    ("liere", {"partial_rotary_factor": 0.5}),
    ("comrope", {}),
    ("comrope", {"variant": "ld", "block_size": 2}),
    ("comrope", {"partial_rotary_factor": 0.5, "matrix_exp_dtype": "float64"}),
]


@pytest.mark.parametrize(("name", "params"), ENCODINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("positions", [[40], [0, 1, 2, 5, 9, 17, 40]], ids=["one token", "seven tokens"])
def test_decoding_step_rotation_equals_matrix_exp_reference(name, params, positions):
    """Without gradients a call of at most FEW_TOKENS tokens (a decoding step, q and k turned
    side by side) gives per-position matrix_exp's rotation (fp64) too, in q's and k's layout."""
    model, generator = _perturbed(name, params, 1)
    posenc = model.posenc
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.hidden_size // heads
    where = torch.tensor([positions])
    assert where.shape[1] <= skew_rotation.FEW_TOKENS
    q = torch.randn(1, heads, where.shape[1], d, generator=generator)
    k = torch.randn(1, kv_heads, where.shape[1], d, generator=generator)
    with torch.no_grad():
        q_rot, k_rot = posenc.rotate(probe_layer_call(where, 1), q, k)
    params64 = {n: p.detach().double() for n, p in posenc.named_parameters()}
    want_q, want_k = rotated(name, posenc, 1, where, q.double(), k.double(), params64)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    torch.testing.assert_close(q_rot.double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot.double(), want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "params"), ENCODINGS, ids=lambda v: str(v))
def test_rotation_and_gradients_equal_matrix_exp_reference(name, params):
    """Rotated q and k, and the gradients of a random linear function of them with respect to
    every parameter of the encoding, equal autograd through per-position matrix_exp (fp64) of
    the generators assembled from the raw parameters; the decomposed path is the one taken."""
    model, generator = _perturbed(name, params, 0)
    posenc = model.posenc
    layer = 1
    assert posenc.decomposed(layer, ForwardMemo()) is not None
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.hidden_size // heads
    positions = torch.tensor([[0, 1, 2, 5, 9, 17, 40]])
    q = torch.randn(1, heads, positions.shape[1], d, generator=generator).requires_grad_()
    k = torch.randn(1, kv_heads, positions.shape[1], d, generator=generator).requires_grad_()
    grad_q, grad_k = torch.randn(q.shape, generator=generator), torch.randn(k.shape, generator=generator)

    q_rot, k_rot = posenc.rotate(probe_layer_call(positions, layer), q, k)
    ((q_rot * grad_q).sum() + (k_rot * grad_k).sum()).backward()
    got = {n: p.grad for n, p in posenc.named_parameters()}
    got_q, got_k = q.grad, k.grad

    params64 = {n: p.detach().double().requires_grad_() for n, p in posenc.named_parameters()}
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want_q, want_k = rotated(name, posenc, layer, positions, q64, k64, params64)
    ((want_q * grad_q.double()).sum() + (want_k * grad_k.double()).sum()).backward()
    torch.testing.assert_close(q_rot.double(), want_q.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot.double(), want_k.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_q.double(), q64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k.double(), k64.grad, atol=1e-5, rtol=1e-5)
    for n, p in params64.items():
        scale = float(p.grad.abs().max().clamp_min(1.0))
        torch.testing.assert_close(got[n].double(), p.grad, atol=1e-5 * scale, rtol=1e-5, msg=n)


@pytest.mark.parametrize("name", ["liere", "comrope"])
def test_a_generator_with_a_repeated_frequency_takes_the_matrix_exp_path(name):
    """Generators whose eigenvalues coincide (every block the same 2x2 rotation) have no unique
    eigenbasis: the layer falls back to matrix_exp, still equals the reference, gradients finite."""
    params = {"block_size": 4} if name == "liere" else {"block_size": 4}
    model = patch(make_model("llama"), name, params, randomize=False)
    posenc = model.posenc
    with torch.no_grad():
        weights = posenc.generators if name == "liere" else posenc.generator
        weights.zero_()
        weights[..., 0, 1] = 0.2
        weights[..., 2, 3] = 0.2
    assert posenc.decomposed(0, ForwardMemo()) is None
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.hidden_size // heads
    positions = torch.arange(5)[None]
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, 5, d, generator=generator)
    k = torch.randn(1, kv_heads, 5, d, generator=generator)
    q_rot, k_rot = posenc.rotate(probe_layer_call(positions, 0), q, k)
    (q_rot.sum() + k_rot.sum()).backward()
    params64 = {n: p.detach().double() for n, p in posenc.named_parameters()}
    want_q, want_k = rotated(name, posenc, 0, positions, q, k, params64)
    torch.testing.assert_close(q_rot.double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot.double(), want_k, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in posenc.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", ["liere", "comrope"])
@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_initial_generators_are_decomposed(name, theta, head_dim):
    """At initialisation (RoPE's frequencies, down to ~1e-6 for theta 5e5) the eigenbasis path
    serves, so a patched pretrained model gets RoPE's cost from its first step."""
    model = make_model("llama", hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1)
    posenc = patch(model, name, {"theta": theta}, randomize=False).posenc
    assert posenc.decomposed(0, ForwardMemo()) is not None


@pytest.mark.parametrize("name", ["liere", "comrope"])
def test_bfloat16_rotation_and_gradients_stay_within_bfloat16_rounding(name):
    """In bf16 (the input kept for backward instead of the rounded output) the rotated q, k and
    every gradient stay within bf16 rounding (2e-2 relative to the largest value) of the fp64
    matrix_exp reference, for a batch of two rows with different positions (left padding)."""
    model, generator = _perturbed(name, {}, 2)
    posenc = model.posenc
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    d = model.config.hidden_size // heads
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    q = torch.randn(2, heads, 6, d, generator=generator)
    k = torch.randn(2, kv_heads, 6, d, generator=generator)
    grad_q, grad_k = torch.randn(q.shape, generator=generator), torch.randn(k.shape, generator=generator)
    q16, k16 = q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_()
    q_rot, k_rot = posenc.rotate(probe_layer_call(positions, 0), q16, k16)
    assert q_rot.dtype == k_rot.dtype == torch.bfloat16
    ((q_rot.float() * grad_q).sum() + (k_rot.float() * grad_k).sum()).backward()
    got = {n: p.grad.double() for n, p in posenc.named_parameters()}

    params64 = {n: p.detach().double().requires_grad_() for n, p in posenc.named_parameters()}
    q64, k64 = q16.detach().double().requires_grad_(), k16.detach().double().requires_grad_()
    total = 0
    for row in range(2):
        want_q, want_k = rotated(
            name, posenc, 0, positions[row : row + 1], q64[row : row + 1], k64[row : row + 1], params64
        )
        total = (
            total
            + (want_q * grad_q[row : row + 1].double()).sum()
            + (want_k * grad_k[row : row + 1].double()).sum()
        )
        for got_x, want_x in ((q_rot[row : row + 1], want_q), (k_rot[row : row + 1], want_k)):
            close(got_x.double(), want_x.detach())
    total.backward()
    close(q16.grad.double(), q64.grad)
    close(k16.grad.double(), k64.grad)
    for n, p in params64.items():
        close(got[n], p.grad, msg=n)


def close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Within bf16 rounding: 2e-2 of the largest magnitude of ``want``."""
    scale = float(want.abs().max().clamp_min(1e-3))
    torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=0, msg=msg)


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one training forward."""
    with saved_storages() as storages:
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()  # the kept tensors serve a real backward
    return sum(storages.values())


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", ["liere", "comrope"])
def test_training_keeps_what_rope_keeps(name, kv_heads):
    """Issue 21.5: per token and layer, a training forward keeps beyond what the same model with
    RoPE keeps only the angles (Hkv * d/2 fp32, an eighth of q and k) and the positions; with
    grouped keys also the rotated keys (SDPA keeps its per-query-head copy instead): none of
    the rotation's (B, H, T, d) intermediates (x, x W, rotate_half, the rotated z, cos and
    sin), which made its training memory 1.5x. Measured as the growth from T to 2T, so the
    per-layer constants (the generators' decomposition) cancel."""
    model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads).train()
    patched = patch(copy.deepcopy(model), name, {}, randomize=False)
    rope = patch(copy.deepcopy(model), "rope", {}, randomize=False)
    short, long = token_ids(1, 64), token_ids(1, 128)
    growth = (_saved_bytes(patched, long) - _saved_bytes(patched, short)) - (
        _saved_bytes(rope, long) - _saved_bytes(rope, short)
    )
    d = 64 // 4
    per_token = kv_heads * d // 2 + 1 + (kv_heads * d if kv_heads < 4 else 0)  # fp32 values per layer
    assert growth <= model.config.num_hidden_layers * 64 * per_token * 4, growth


def _forward_peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The most bytes allocated at once during one inference forward."""
    with torch.no_grad():
        return peak_allocated_bytes(lambda: model(ids, use_cache=False))


@pytest.mark.parametrize("name", ["liere", "comrope"])
def test_inference_peak_grows_as_ropes(name):
    """Issue 21.5 (<= 1.2x RoPE's memory): an inference forward's peak allocation grows from T
    to 2T by at most RoPE's growth plus three (Hkv, d/2) fp32 values per token (the angles, their
    cosine and sine): the rotation's temporaries (x W, the turned halves, their products, the
    turned x W^T) are written into buffers of q's size, one at a time. Before, they held up to four
    more (B, H, T, d) fp32 tensors at the peak (forward peak 1.23x native at T=4096 in the
    benchmark's model)."""
    model = make_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4).eval()
    patched = patch(copy.deepcopy(model), name, {}, randomize=False)
    rope = patch(copy.deepcopy(model), "rope", {}, randomize=False)
    short, long = token_ids(1, 256), token_ids(1, 512)
    growth = (_forward_peak(patched, long) - _forward_peak(patched, short)) - (
        _forward_peak(rope, long) - _forward_peak(rope, short)
    )
    kv_heads, d = 4, 64 // 4
    assert growth <= 256 * 3 * kv_heads * d // 2 * 4, growth


def test_kept_decompositions_reuse_equal_generators_and_recompute_changed_ones():
    """A decomposition is reused for generators of equal values (another tensor object too) and
    computed again when the values change in place, even through ``.data`` (no version bump), or
    when the dtype or shape differs."""
    from hf_posenc.encodings.kept_values import KeptValues

    calls: list[torch.Tensor] = []

    def compute(skew: torch.Tensor) -> float:
        calls.append(skew)
        return float(skew.sum())

    kept = KeptValues()
    generators = torch.randn(2, 4, 4)
    assert kept.get(0, (generators,), compute) == float(generators.sum())
    assert kept.get(0, (generators.clone(),), compute) == float(generators.sum()) and len(calls) == 1
    generators.data.add_(1.0)  # an edit the version counter does not see
    assert kept.get(0, (generators,), compute) == float(generators.sum()) and len(calls) == 2
    assert kept.get(1, (generators,), compute) == float(generators.sum()) and len(calls) == 3  # its own key
    kept.get(0, (generators.double(),), compute)
    kept.get(0, (generators[:1],), compute)
    assert len(calls) == 5


@pytest.mark.parametrize("name", ["comrope", "liere"])
def test_decoding_steps_reuse_the_decomposition_and_see_changed_generators(name, monkeypatch):
    """Cached decoding: after the prompt no step runs ``eigh`` again (the generators did not
    change); after the generators are edited through ``.data`` the next steps' logits equal a
    model freshly built with the edited values (the full forward over prompt and steps)."""
    from transformers import DynamicCache

    model = patch(make_model("llama"), name)
    eighs = []
    original = torch.linalg.eigh

    def counting(*args, **kwargs):
        eighs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", counting)
    ids = token_ids(1, 24)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :16], past_key_values=cache, use_cache=True)
        prompt_eighs = len(eighs)
        for t in range(16, 20):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert prompt_eighs > 0 and len(eighs) == prompt_eighs  # steps reuse the kept decompositions
        for parameter in model.posenc.parameters():
            parameter.data.add_(0.01 * torch.randn_like(parameter))  # the version counter does not move
        fresh = patch(make_model("llama"), name, randomize=False)
        fresh.load_state_dict(model.state_dict())
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :20], past_key_values=cache, use_cache=True).logits]
        for t in range(20, 24):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        reference = fresh(ids).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["comrope", "liere"])
def test_a_decomposition_kept_in_inference_mode_never_enters_a_training_step(name):
    """Generators frozen: a forward under torch.inference_mode, then a training step (gradients
    for the rest of the model) and a forward under no_grad: the step runs (no inference tensor
    saved for backward) and every forward's logits equal a fresh model's."""
    model = patch(make_model("llama"), name)
    model.posenc.requires_grad_(False)
    fresh = patch(make_model("llama"), name, randomize=False)
    fresh.load_state_dict(model.state_dict())
    ids = token_ids(1, 12)
    with torch.no_grad():
        reference = fresh(ids).logits
    with torch.inference_mode():
        inferred = model(ids).logits.clone()
    out = model(ids, labels=ids)
    out.loss.backward()
    with torch.no_grad():
        again = model(ids).logits
    for logits in (inferred, out.logits.detach(), again):
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
