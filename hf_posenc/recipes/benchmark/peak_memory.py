"""The peak of what one training step allocates, per token, and what is alive at that peak.

    python -m hf_posenc.recipes.benchmark.peak_memory --encodings tape fox_pro rerope \
        [--hidden-size 256 --num-layers 4 --num-heads 4 --vocab-size 32000 --loss chunked] \
        [--lengths 4096 8192] [--detail] [--json FILE]

One training step (forward, loss, backward; batch 1, random weights, the model of
:mod:`.max_length`), native beside each encoding, at two lengths, under torch's profiler with
``profile_memory``: every allocation and free of torch's CPU allocator, in order, with its
address. Their running sum is the bytes the step's tensors hold at each moment, so its
maximum (the peak) counts neither the C heap's holes nor other processes: it is independent of
load and allocator, where :mod:`.max_length`'s resident-set slope needs an idle machine (or
``MALLOC_MMAP_THRESHOLD_``) to read the same. Two peaks per step:

* ``peak``: the whole step's (with ``--loss chunked`` at these lengths: while the loss's
  chunks run backward, everything saved for backward alive);
* ``layers``: after the loss's backward (its last free of 200 MiB or more; the whole step where
  there is none), while the layers run backward: what is saved minus what was freed, plus one
  layer's transient tensors. Where it grows faster per token than ``peak``, it is the one that
  bounds the maximum length at large budgets.

``--inference``: one forward without gradients instead (eval mode, no loss): its peak is
both columns' (the ``layers`` peak is a training step's).

Per row: both peaks at both lengths and their slopes in KiB per token. ``--detail``: the
tensors alive at the longer length's two peaks, grouped by size and by the operation and the
hf_posenc / transformers lines that allocated them (``with_stack``; slower).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ..atomic import replacing
from . import max_length, saved_memory

#: a free this large ends the chunked loss's backward (its chunks' (tokens x vocabulary) logits)
LOSS_FREE = 200 << 20
SOURCES = ("hf_posenc", "modeling_")


def _where(node: Any) -> str:
    """The two innermost operations and three innermost source lines around an allocation."""
    ops: list[str] = []
    lines: list[str] = []
    parent = node.parent
    while parent is not None:
        if parent.tag == _EventType.PyCall:
            if any(s in parent.name for s in SOURCES) and "benchmark" not in parent.name:
                lines.append(parent.name.rsplit("/", 1)[-1])
        elif parent.tag == _EventType.TorchOp:
            ops.append(parent.name)
        parent = parent.parent
    return " < ".join(ops[:2]) + " @ " + " < ".join(lines[:3])


def allocation_events(prof: Any) -> list[Any]:
    """The allocation and free events of a ``profile(profile_memory=True)`` run, in time order."""
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            events.append(node)
        pending.extend(node.children)
    return sorted(events, key=lambda node: node.start_time_ns)


def allocated_bytes(events: list[Any]) -> Iterator[tuple[int, int]]:
    """(index, bytes allocated above the start) after each event of :func:`allocation_events`.
    Only frees of blocks allocated in the run count: a block of an earlier step (the previous
    row's model, freed by the collector meanwhile) would lower the running sum."""
    allocated: set[int] = set()
    current = 0
    for i, node in enumerate(events):
        fields = node.extra_fields
        if fields.alloc_size > 0:
            allocated.add(fields.ptr)
        elif fields.ptr in allocated:
            allocated.discard(fields.ptr)
        else:
            continue
        current += fields.alloc_size
        yield i, current


def _alive(allocations: list[Any], until: int, min_bytes: int) -> list[dict[str, Any]]:
    """The allocations alive just after ``allocations[until]``, grouped by size and site."""
    alive: dict[int, Any] = {}
    for node in allocations[: until + 1]:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            alive[fields.ptr] = node
        else:
            alive.pop(fields.ptr, None)
    groups: collections.Counter[tuple[int, str]] = collections.Counter(
        (node.extra_fields.alloc_size, _where(node))
        for node in alive.values()
        if node.extra_fields.alloc_size >= min_bytes
    )
    ranked = sorted(groups.items(), key=lambda item: -item[0][0] * item[1])
    return [{"count": count, "bytes": size, "site": site} for (size, site), count in ranked]


def step_peaks(args: argparse.Namespace, name: str, length: int, detail: bool) -> dict[str, Any]:
    """Both peaks (bytes above what was allocated before the step) of one step at ``length``."""
    from ..training.loss import loss_function

    gc.collect()  # the previous step's model and graph, before the profiler starts
    torch.manual_seed(0)
    model = max_length._model(args, name, length)
    ids = torch.randint(3, args.vocab_size, (1, length), device=args.device)
    loss_of = loss_function(args.loss, model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=detail) as prof:
        if args.inference:  # one forward without gradients: the logits, no loss
            with torch.no_grad():
                model.eval()(ids, use_cache=False)
        else:
            loss_of(model, {"input_ids": ids, "labels": ids, "use_cache": False}).backward()
    allocations = allocation_events(prof)
    loss_end = max(
        (i for i, node in enumerate(allocations) if node.extra_fields.alloc_size <= -LOSS_FREE), default=-1
    )
    peaks = {"peak": (0, 0), "layers": (0, 0)}
    for i, current in allocated_bytes(allocations):
        for key in ("peak",) if i <= loss_end else ("peak", "layers"):
            if current > peaks[key][0]:
                peaks[key] = (current, i)
    row: dict[str, Any] = {key: value for key, (value, _) in peaks.items()}
    if detail:
        row["alive"] = {key: _alive(allocations, at, args.min_bytes) for key, (_, at) in peaks.items()}
    return row


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    max_length.model_arguments(p, hidden=256, layers=4, heads=4)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--inference",
        action="store_true",
        help="one forward without gradients (eval mode) instead of a training step; its peak in both columns",
    )
    p.add_argument("--lengths", nargs=2, type=int, default=[4096, 8192], metavar=("SHORT", "LONG"))
    p.add_argument("--detail", action="store_true", help="list what is alive at the longer length's peaks")
    p.add_argument("--min-bytes", type=int, default=1 << 20, help="--detail: smallest allocation listed")
    p.add_argument("--json", default=None, metavar="FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = saved_memory.check_lengths_and_encodings(parser(), args)
    if args.device != "cpu":
        parser().error(
            f"--device {args.device}: only cpu (on CUDA, max_length reads the CUDA allocator's peak)"
        )
    if args.inference and args.gradient_checkpointing:
        parser().error("--gradient-checkpointing: a training step's setting; --inference runs no backward")
    short, long = args.lengths
    torch.set_num_threads(1)
    rows = []
    print("| row | peak KiB/token | layers' backward KiB/token | peak at LONG (MiB) |\n|---|---|---|---|")
    for name in [max_length.NATIVE, *names]:
        at_short = step_peaks(args, name, short, detail=False)
        at_long = step_peaks(args, name, long, detail=args.detail)
        slope = {key: (at_long[key] - at_short[key]) / (long - short) / 1024 for key in ("peak", "layers")}
        rows.append({"row": name, "short": at_short, "long": at_long, "kib_per_token": slope})
        print(
            f"| {name} | {slope['peak']:.1f} | {slope['layers']:.1f} | {at_long['peak'] / 2**20:.0f} |",
            flush=True,
        )
        for key, alive in at_long.get("alive", {}).items():
            print(f"  alive at the {key} peak ({long} tokens):")
            for group in alive:
                print(f"  {group['count']:4d} x {group['bytes'] / 2**20:8.2f} MiB  {group['site']}")
    if args.json:
        with replacing(args.json) as partial, open(partial, "w") as handle:
            json.dump({"settings": vars(args), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
