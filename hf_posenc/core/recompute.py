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
deterministic and free of side effects (it runs twice). Without gradients, under
``torch.compile`` (whose partitioner decides what to recompute itself), and inside a region
that ``torch.utils.checkpoint`` recomputes already (gradient checkpointing of the decoder
layers: the whole layer is run again in backward, so recomputing a step inside it again would
be a third forward, for nothing), it is a plain call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

Output = torch.Tensor | tuple[torch.Tensor, ...]


def _discard(tensor: torch.Tensor) -> None:
    """What the forward's throwaway graph saves: nothing (see :meth:`_Recomputed.forward`)."""
    return None


def _never(packed: None) -> torch.Tensor:
    raise RuntimeError("recomputed: the forward's own graph is never run backward")


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, run: Callable[[], Output], function: Callable[..., Output], *inputs: torch.Tensor
    ) -> Output:
        ctx.function = function  # backward: function(*inputs), with gradients
        ctx.save_for_backward(*inputs)
        ctx.inputs = [weakref.ref(t) for t in inputs]  # for a consumer that chains (never keeps them)
        # with gradients on detached copies, as backward will run it: a function whose path depends
        # on the grad mode (an attention backend's choice) takes the same path both times. That
        # graph is never run backward, so it saves nothing (an outer hook, a checkpoint's or a
        # counter's, never sees it either). Saving its tensors as they are would also make a
        # reference cycle wherever an operation saves its own output (SDPA does: node -> saved
        # output -> its grad_fn -> node), which only Python's cyclic collector frees: the
        # graph's tensors (TAPE's padded q and k, widened values, their leaves) stayed alive
        # long after the call, up to 4 (B, H, T, 2D) tensors per layer at the loss's backward.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard, _never):
            out = run()
        ctx.single = isinstance(out, torch.Tensor)
        if isinstance(out, torch.Tensor):
            return out.detach()
        return tuple(o.detach() for o in out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        _REBUILDING.append({})
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            _REBUILDING.pop()
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None]
        wanted = [t for t in inputs if t.requires_grad]
        found: tuple[torch.Tensor | None, ...] = ()
        if wanted and pairs:
            found = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
        by_input = iter(found)
        return (None, None, *(next(by_input, None) if t.requires_grad else None for t in inputs))


#: while a backward rebuilds its inputs: (producer, ids of its inputs) -> (inputs, output), so a
#: producer that several chained inputs share (TAPE's stream, rebuilt for q's rotation, k's and
#: the attended stream) runs once, with one graph, not once per consumer
_REBUILDING: list[dict[tuple[int, ...], tuple[list[torch.Tensor], Output]]] = []


def _rebuilt(made: Callable[..., Output], args: list[torch.Tensor]) -> Output:
    """``made(*args)``, shared within the backward that is running (see ``_REBUILDING``)."""
    if not _REBUILDING:
        return made(*args)
    cache = _REBUILDING[-1]
    key = (id(made), *map(id, args))
    if key not in cache:
        cache[key] = (args, made(*args))  # args kept with it: their ids stay theirs
    return cache[key][1]


def _producer(tensor: torch.Tensor) -> tuple[Callable[..., Output], list[torch.Tensor]] | None:
    """(function, inputs) when ``tensor`` is the whole output of a recomputed call whose inputs
    are all alive, or a reshaped view of all of it (an attention's (B, T, H, D) output viewed as
    (B, T, H*D)): the consumer can keep those and rebuild ``tensor`` from them."""
    node, shape = tensor.grad_fn, None
    if type(node).__name__ == "ViewBackward0" and tensor._is_view():
        base = tensor._base
        if base is None or base.numel() != tensor.numel() or tensor.storage_offset() != base.storage_offset():
            return None
        if not (tensor.is_contiguous() and base.is_contiguous()):  # a reshape of the whole, in order
            return None
        node, shape = base.grad_fn, tuple(tensor.shape)
    if not isinstance(node, _Recomputed._backward_cls) or not getattr(node, "single", False):
        return None
    inputs = [ref() for ref in node.inputs]
    if any(t is None for t in inputs):
        return None
    if shape is None:
        return node.function, inputs
    made = node.function

    def viewed(*values: torch.Tensor) -> Output:
        out = made(*values)
        assert isinstance(out, torch.Tensor)  # a single output (node.single)
        return out.view(shape)

    return viewed, inputs


def chains(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole output of a recomputed call that a consumer passed to
    :func:`recomputed` would rebuild rather than keep."""
    return tensor.requires_grad and not torch.compiler.is_compiling() and _producer(tensor) is not None


def recomputed(function: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``function(*inputs)`` (a tensor or a tuple of tensors), keeping only ``inputs`` for backward.

    An input that is itself the single output of a recomputed call is not kept either: its
    producer's inputs are (kept by the producer already), and backward rebuilds it from them
    first, so a chain of recomputed steps keeps only the inputs of its first step that are not
    made inside the chain (e.g. a rotation and the attention it feeds: the unrotated q and k,
    not the rotated ones too). The gradient then reaches the producer's inputs through this
    call's backward; the producer's own node receives none. A tensor several producers share
    is kept once, and a producer several inputs share (the same function of the same tensors)
    is rebuilt once per backward."""
    from ..compat import in_activation_checkpoint  # here: compat imports transformers

    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or in_activation_checkpoint():
        return function(*inputs)
    if not any(t.requires_grad for t in inputs):
        return function(*inputs)
    flat: list[torch.Tensor] = []  # each tensor once (a shared producer input appears once)
    where: dict[int, int] = {}  # id(tensor) -> its index in flat

    def index(tensor: torch.Tensor) -> int:
        if id(tensor) not in where:
            where[id(tensor)] = len(flat)
            flat.append(tensor)
        return where[id(tensor)]

    parts: list[tuple[Callable[..., Any] | None, list[int]]] = []  # per input: producer or None, its values
    for tensor in inputs:
        producer = _producer(tensor) if tensor.requires_grad else None
        if producer is None:
            parts.append((None, [index(tensor)]))
        else:
            parts.append((producer[0], [index(t) for t in producer[1]]))
    rebuild = function
    if any(made is not None for made, _ in parts) or len(flat) < len(inputs):

        def rebuild(*values: torch.Tensor) -> Any:
            args = [
                values[at[0]] if made is None else _rebuilt(made, [values[i] for i in at])
                for made, at in parts
            ]
            return function(*args)

    def run() -> Any:
        return function(*(t.detach().requires_grad_(t.requires_grad) for t in inputs))

    return _Recomputed.apply(run, rebuild, *flat)


#: (inputs, outputs) -> (the output tensor(s), what backward needs beyond the inputs)
KernelForward = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
#: (inputs, saved, grad of the output) -> a gradient (or None) per input
KernelBackward = Callable[
    [list[torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor], tuple[torch.Tensor | None, ...]
]


class _Kernel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, forward: Callable[[], Any], backward: Any, rebuild: Any, *flat: torch.Tensor
    ) -> Any:
        out, saved = forward()
        ctx.backward, ctx.rebuild, ctx.flat_count = backward, rebuild, len(flat)
        ctx.save_for_backward(*flat, *saved)
        return out

    @staticmethod
    @once_differentiable  # the kernel's backward has no derivative: a double backward says so
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        stored = ctx.saved_tensors
        flat, saved = stored[: ctx.flat_count], stored[ctx.flat_count :]
        needs = ctx.needs_input_grad[3:]
        leaves = [t.detach().requires_grad_(need) for t, need in zip(flat, needs, strict=True)]
        _REBUILDING.append({})
        try:
            with torch.enable_grad():
                args = ctx.rebuild(*leaves)  # the kernel's inputs; chained ones rebuilt with their graph
        finally:
            _REBUILDING.pop()
        with torch.no_grad():
            found = ctx.backward([a.detach() for a in args], saved, grad)
        direct: dict[int, torch.Tensor] = {}  # leaf index -> gradient reaching it unchanged
        through: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rebuilt input, its gradient)
        for arg, g in zip(args, found, strict=True):
            if g is None or not arg.requires_grad:
                continue
            at = next((i for i, leaf in enumerate(leaves) if leaf is arg), None)
            if at is None:
                through.append((arg, g))
            else:
                direct[at] = g if at not in direct else direct[at] + g
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        if through and wanted:
            more = torch.autograd.grad(
                [a for a, _ in through], wanted, [g for _, g in through], allow_unused=True
            )
            by_leaf = dict(zip(map(id, wanted), more, strict=True))
            for i, leaf in enumerate(leaves):
                extra = by_leaf.get(id(leaf))
                if extra is not None:
                    direct[i] = extra if i not in direct else direct[i] + extra
        return (
            None,
            None,
            None,
            *(direct.get(i) if leaf.requires_grad else None for i, leaf in enumerate(leaves)),
        )


def kernel(forward: KernelForward, backward: KernelBackward, *inputs: torch.Tensor) -> torch.Tensor:
    """``forward(*inputs)``'s output, differentiated by ``backward`` (a kernel with its own backward,
    e.g. a fused attention whose backward operator takes the forward's statistics).

    ``forward(*inputs) -> (output, saved)`` runs without gradients; ``saved`` (e.g. the output
    itself and its softmax statistics) is kept with the inputs. ``backward(inputs, saved,
    grad_output)`` returns a gradient (or None) per input. An input that is the whole output of a
    :func:`recomputed` call (a rotation) is kept as its producer's inputs, like
    :func:`recomputed` does, rebuilt before ``backward`` runs, and its gradient continues
    through the rebuilt graph to them. Without gradients it is ``forward(*inputs)[0]``."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        with torch.no_grad():
            return forward(*inputs)[0]
    flat: list[torch.Tensor] = []
    where: dict[int, int] = {}

    def index(tensor: torch.Tensor) -> int:
        if id(tensor) not in where:
            where[id(tensor)] = len(flat)
            flat.append(tensor)
        return where[id(tensor)]

    parts: list[tuple[Callable[..., Any] | None, list[int]]] = []
    for tensor in inputs:
        producer = _producer(tensor) if chains(tensor) else None
        if producer is None:
            parts.append((None, [index(tensor)]))
        else:
            parts.append((producer[0], [index(t) for t in producer[1]]))

    def rebuild(*values: torch.Tensor) -> list[Any]:  # producers give single tensors (_producer)
        return [
            values[at[0]] if made is None else _rebuilt(made, [values[i] for i in at]) for made, at in parts
        ]

    def run() -> Any:
        with torch.no_grad():
            return forward(*(t.detach() for t in inputs))

    return _Kernel.apply(run, backward, rebuild, *flat)
