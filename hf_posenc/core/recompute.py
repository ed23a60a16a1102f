"""Run a cheap function whose intermediates autograd would otherwise keep, keeping only its inputs.

``recomputed(function, *inputs)`` returns ``function(*inputs)``; for backward it keeps the
``inputs`` (``save_for_backward``) and runs ``function`` again on them. An encoding's elementwise
steps (a token shift, a per-head RMS norm, a rotation by a stream that carries gradients) each
keep one or two (B, H, T, D) intermediates per layer under plain autograd; recomputed, a step
keeps its inputs only, which the model usually holds anyway. The recomputation runs the same
operations on the same values, so gradients are the same bits.

Why not ``torch.utils.checkpoint``: what it keeps is invisible to ``saved_tensors_hooks`` (the
inputs stay alive through its closure), so the saved state of a training step could not be
listed or tested; this one saves through ``ctx.save_for_backward`` like any autograd node.

Every tensor the gradient must reach (inputs and parameters alike) is passed in ``inputs``;
other arguments are bound into ``function`` (``functools.partial``). ``function`` must be
deterministic and free of side effects (it runs twice). Without gradients, and under
``torch.compile`` (whose partitioner decides what to recompute itself), it is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Output = torch.Tensor | tuple[torch.Tensor, ...]


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable[..., Output], *inputs: torch.Tensor) -> Output:
        ctx.function = function
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return function(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        found: tuple[torch.Tensor | None, ...] = ()
        if wanted and pairs:
            found = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        by_input = iter(found)
        return (None, *(next(by_input, None) if t.requires_grad else None for t in inputs))


def recomputed(function: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``function(*inputs)`` (a tensor or a tuple of tensors), keeping only ``inputs`` for backward."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return function(*inputs)
    if not any(t.requires_grad for t in inputs):
        return function(*inputs)
    return _Recomputed.apply(function, *inputs)
