"""Shared test helpers: record what every attention layer saw and returned, and what autograd
saves for backward."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch
from conftest import attention_modules

from hf_posenc.recipes.benchmark.peak_memory import allocated_bytes, allocation_events

LENGTH = 12  # longer than Mistral's sliding window of 8


def run_and_capture(model, ids, **kwargs):
    """Run a forward (with ``kwargs``) and record (hidden input, output) of every attention module
    and the input of layer 0."""
    records, handles = {}, []
    attention = attention_modules(model)
    first_layer = next(m for m in model.modules() if any(c is attention[0] for c in m.children()))

    def attention_hook(idx):
        def hook(module, args, kwargs, output):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            records[idx] = (hidden.detach(), output[0].detach())

        return hook

    def layer_hook(module, args, kwargs):
        records["layer0_input"] = (args[0] if args else kwargs["hidden_states"]).detach()

    for idx, module in enumerate(attention):
        handles.append(module.register_forward_hook(attention_hook(idx), with_kwargs=True))
    handles.append(first_layer.register_forward_pre_hook(layer_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return records, attention


@contextlib.contextmanager
def saved_storages() -> Iterator[dict[int, int]]:
    """Inside the block, record the distinct storages autograd saves for backward ({data pointer:
    bytes}): a view and its base count once."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


def peak_allocated_bytes(step: Callable[[], object]) -> int:
    """The most CPU bytes allocated at once while ``step()`` runs (above what was allocated
    before it), from torch's profiler allocation events: every allocation and free of torch's
    CPU allocator, in order, with its address (frees of blocks allocated before are left out).
    It counts what the tensors hold, not the C heap's resident pages, so it does not depend on
    load or on the allocator's behaviour."""
    gc.collect()  # what earlier tests left to the collector, before the profiler starts
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        step()
    # the benchmark's own event walk (hf_posenc.recipes.benchmark.peak_memory), not a copy of it
    return max((current for _, current in allocated_bytes(allocation_events(prof))), default=0)
