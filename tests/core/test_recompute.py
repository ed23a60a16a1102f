"""Property: ``recomputed(f, *inputs)`` is ``f(*inputs)`` in value and gradient (the backward
re-runs f on the same values: the same bits), keeps only its inputs for backward, and is a
plain call without gradients."""

from __future__ import annotations

import functools
import gc
import weakref

import torch
from capture import saved_storages
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_posenc.core.recompute import recomputed


def _shift_norm(x: torch.Tensor, alpha: torch.Tensor, gain: torch.Tensor, eps: float):
    """Two outputs from a chain of elementwise steps (each would keep a (B, T, D) intermediate)."""
    shifted = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
    mixed = alpha * shifted + (1 - alpha) * x
    normed = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + eps) * gain
    return normed, mixed.sigmoid()


@settings(max_examples=20, deadline=None)
@given(
    length=st.integers(1, 9),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    wanted=st.sampled_from([(True, True, True), (True, False, True), (False, True, False)]),
    use_second=st.booleans(),
)
def test_recomputed_equals_the_plain_call_in_value_and_gradient(length, width, seed, wanted, use_second):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, length, width), (2, length, 1), (width,)]
    plain = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    function = functools.partial(_shift_norm, eps=1e-5)

    def run(call):
        inputs = [t.clone().requires_grad_(w) for t, w in zip(plain, wanted, strict=True)]
        first, second = call(function, *inputs)
        loss = (first * torch.arange(first.numel(), dtype=first.dtype).view_as(first)).sum()
        if use_second:
            loss = loss + second.sum()
        loss.backward()
        return first.detach(), [t.grad for t in inputs]

    want_out, want_grads = run(lambda f, *xs: f(*xs))
    got_out, got_grads = run(recomputed)
    assert torch.equal(got_out, want_out)
    for got, want, w in zip(got_grads, want_grads, wanted, strict=True):
        assert (got is None) == (not w)
        if w:
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_recomputed_keeps_only_its_inputs():
    """Autograd keeps the three inputs of the recomputed chain, none of its intermediates."""
    x = torch.randn(2, 16, 8, requires_grad=True)
    alpha = torch.rand(2, 16, 1, requires_grad=True)
    gain = torch.randn(8, requires_grad=True)
    with saved_storages() as kept:
        first, _ = recomputed(functools.partial(_shift_norm, eps=1e-5), x, alpha, gain)
    first.sum().backward()
    assert sum(kept.values()) == (x.numel() + alpha.numel() + gain.numel()) * 4


def test_without_gradients_it_is_a_plain_call():
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        out = recomputed(torch.sin, x)
    assert out.grad_fn is None and torch.equal(out, torch.sin(x.detach()))


def _rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    return x * angle.cos() + x.flip(-1) * angle.sin()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def test_a_chain_keeps_the_inputs_of_its_first_step_only():
    """attend(recomputed rotate(q), recomputed rotate(k), v), itself recomputed: the rotated q and
    k are rebuilt in the attention's backward, not kept; values and gradients equal the plain
    composition's (fp64, 1e-12)."""
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 6, 4, generator=generator, dtype=torch.float64) for _ in range(4)]
    grad = torch.randn(2, 6, 4, generator=generator, dtype=torch.float64)

    def run(call):
        q, k, v, angle = (t.clone().requires_grad_() for t in base)
        with saved_storages() as kept:
            out = call(_attend, call(_rotate, q, angle), call(_rotate, k, angle), v)
        (out * grad).sum().backward()
        return out.detach(), [t.grad for t in (q, k, v, angle)], sum(kept.values())

    want_out, want_grads, _ = run(lambda f, *xs: f(*xs))
    got_out, got_grads, kept = run(recomputed)
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert kept == 4 * base[0].numel() * 8  # q, k, v and the angles: nothing rotated


def test_the_forward_graph_is_freed_with_the_call():
    """What the function's forward graph holds is freed when the call returns, by reference
    counting alone: an operation that saves its own output for backward (exp) would otherwise
    form a cycle (node -> saved output -> its grad_fn -> node) that only Python's cyclic
    collector frees, keeping every tensor of that graph alive meanwhile."""
    made: list[weakref.ref] = []

    def function(x: torch.Tensor) -> torch.Tensor:
        inner = x.exp()  # exp saves its output
        made.append(weakref.ref(inner))
        return inner * 2

    x = torch.randn(4, 3, requires_grad=True)
    gc.disable()
    try:
        out = recomputed(function, x)
        assert made[0]() is None
    finally:
        gc.enable()
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().exp())


def _attend_plus(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return _attend(q, k, v + e)


def test_a_producer_that_chained_inputs_share_is_rebuilt_once():
    """attend(rotate(q, e), rotate(k, e), v, e) with e = mix(h), every step recomputed: in the
    attention's backward the shared e is rebuilt once (one graph, not one per consumer), h is
    kept once; values and gradients equal the plain composition's (fp64, 1e-12)."""
    generator = torch.Generator().manual_seed(1)
    base = [torch.randn(2, 6, 4, generator=generator, dtype=torch.float64) for _ in range(4)]
    grad = torch.randn(2, 6, 4, generator=generator, dtype=torch.float64)
    calls = []

    def mix(h: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return h.tanh() * 3

    def run(call):
        q, k, v, h = (t.clone().requires_grad_() for t in base)
        with saved_storages() as kept:
            e = call(mix, h)
            out = call(_attend_plus, call(_rotate, q, e), call(_rotate, k, e), v, e)
        calls.clear()
        (out * grad).sum().backward()
        return out.detach(), [t.grad for t in (q, k, v, h)], sum(kept.values())

    want_out, want_grads, _ = run(lambda f, *xs: f(*xs))
    got_out, got_grads, kept = run(recomputed)
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert len(calls) == 1  # e rebuilt once in backward (it was three times: per consumer)
    assert kept == 4 * base[0].numel() * 8  # q, k, v and h: nothing rotated, h once


def test_inside_activation_checkpointing_it_is_a_plain_call():
    """Inside ``torch.utils.checkpoint`` (non-reentrant), which runs its region again in backward
    anyway, the step is not recomputed a third time: the function runs once in forward and once
    in the checkpoint's recomputation (not again in its own backward), no recomputed node is
    made, and the gradients are the plain call's (fp64, 1e-12)."""
    runs = []

    def function(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return (x * alpha).sin()

    def region(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        out = recomputed(function, x, alpha)
        nodes.append(type(out.grad_fn).__name__)
        return out.exp()

    generator = torch.Generator().manual_seed(2)
    base = [torch.randn(3, 5, generator=generator, dtype=torch.float64) for _ in range(2)]
    grads = []
    for wrap in (False, True):
        x, alpha = (t.clone().requires_grad_() for t in base)
        nodes: list[str] = []
        runs.clear()
        out = (
            torch.utils.checkpoint.checkpoint(region, x, alpha, use_reentrant=False)
            if wrap
            else region(x, alpha)
        )
        out.sum().backward()
        grads.append((x.grad, alpha.grad))
        if wrap:
            assert len(runs) == 2 and "_Recomputed" not in " ".join(nodes)
        else:
            assert len(runs) == 2 and nodes == ["_RecomputedBackward"]  # forward, then its own backward
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_a_chain_reaches_through_a_reshaped_view():
    """A consumer of a reshaped view of a recomputed output (an attention's (B, T, H, D) output
    viewed as (B, T, H*D)) rebuilds it like the output itself: the chain keeps q, k, v and
    the consumer's own input, not the attention's output; values and gradients equal the plain
    composition's (fp64, 1e-12)."""
    generator = torch.Generator().manual_seed(4)
    base = [torch.randn(2, 6, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    gain = torch.randn(2, 24, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, 24, generator=generator, dtype=torch.float64)

    def gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * g.sigmoid()

    def run(call):
        q, k, v = (t.clone().requires_grad_() for t in base)
        g = gain.clone().requires_grad_()
        with saved_storages() as kept:
            out = call(gate, call(_attend, q, k, v).view(2, 24), g)
        (out * grad).sum().backward()
        return out.detach(), [t.grad for t in (q, k, v, g)], sum(kept.values())

    want_out, want_grads, _ = run(lambda f, *xs: f(*xs))
    got_out, got_grads, kept = run(recomputed)
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert kept == (3 * base[0].numel() + gain.numel()) * 8  # q, k, v, the gain: no attention output
