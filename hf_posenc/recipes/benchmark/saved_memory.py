"""What a training step keeps for backward per token, tensor by tensor, native beside each encoding.

    python -m hf_posenc.recipes.benchmark.saved_memory --encodings xpos fire fox_pro tape \
        [--hidden-size 256 --num-layers 4 --num-heads 4 --vocab-size 32000 --loss chunked] \
        [--lengths 512 1024] [--json FILE]

One training step (forward, loss, backward; batch 1, random weights, the model of
:mod:`.max_length`) at each of two lengths, with ``torch.autograd.graph.saved_tensors_hooks``
recording every distinct storage autograd saves in the forward and the loss (what backward
saves for its own recomputations lives only while it runs): its bytes, the decoder layer it was saved in
(``pre``: before the first, ``post``: after the last), dtype, the operation that made it
(``grad_fn``; ``const`` for a tensor without gradient, ``leaf`` for a parameter) and the lines of
hf_posenc / transformers that saved it. Grouped by everything but the layer index, the growth
between the two lengths per token is what the step keeps per token (per-layer constants, the
weights, cancel). The peak resident memory :mod:`.max_length` reads also holds transient
tensors and the allocator's slack; this lists only what is kept for backward, independent of
load and allocator.
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
from typing import Any

import torch

from ..atomic import replacing
from . import max_length
from .model_check import check_model_arguments

#: lines of these files name where a tensor was saved (the innermost three)
SOURCES = ("hf_posenc", "modeling_")


def _site() -> str:
    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if any(s in f.filename for s in SOURCES) and "benchmark" not in f.filename
    ]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:][::-1])


def saved_storages(args: argparse.Namespace, row: str, length: int) -> dict[int, dict[str, Any]]:
    """The distinct storages one training step at ``length`` saves for backward, by address."""
    torch.manual_seed(0)
    model = max_length._model(args, row, length)
    layers = model.model.layers
    where: dict[str, Any] = {"layer": "pre"}
    handles = [
        layer.register_forward_pre_hook(lambda _m, _a, i=i: where.__setitem__("layer", i))
        for i, layer in enumerate(layers)
    ]
    handles.append(
        model.model.norm.register_forward_pre_hook(lambda _m, _a: where.__setitem__("layer", "post"))
    )
    storages: dict[int, dict[str, Any]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            made = "leaf" if tensor.requires_grad else "const"
            storages[storage.data_ptr()] = {
                "bytes": storage.nbytes(),
                "layer": where["layer"],
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "made_by": type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else made,
                "shape": list(tensor.shape),
                "site": _site(),
            }
        return tensor

    from ..training.loss import loss_function

    ids = torch.randint(3, args.vocab_size, (1, length), device=args.device)
    try:
        # what the forward and the loss keep; what backward saves for its own recomputations
        # (the chunked loss's logits, recomputed blocks) lives only while backward runs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_function(args.loss, model)(
                model, {"input_ids": ids, "labels": ids, "use_cache": False}
            )
    finally:
        for handle in handles:
            handle.remove()
    loss.backward()  # the kept tensors serve a real backward
    return storages


def per_token(args: argparse.Namespace, row: str) -> dict[str, Any]:
    """Bytes per token kept for backward by ``row``, in all and per kind of saved tensor."""
    short, long = args.lengths
    groups: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    shapes: dict[tuple, list[int]] = {}
    for index, length in enumerate((short, long)):
        for entry in saved_storages(args, row, length).values():
            layer = entry["layer"] if entry["layer"] in ("pre", "post") else "layer"
            key = (layer, entry["site"], entry["dtype"], entry["made_by"])
            groups[key][index] += entry["bytes"]
            shapes[key] = entry["shape"]
    kinds = []
    for key, (a, b) in groups.items():
        growth = (b - a) / (long - short)
        if abs(growth) >= 1:
            layer, site, dtype, made_by = key
            kinds.append(
                {"bytes_per_token": growth, "where": layer, "dtype": dtype, "made_by": made_by}
                | {"shape_at_long": shapes[key], "site": site}
            )
    kinds.sort(key=lambda k: -k["bytes_per_token"])
    total = sum((b - a) for a, b in groups.values()) / (long - short)
    return {"row": row, "bytes_per_token": total, "kinds": kinds}


def report(rows: list[dict[str, Any]]) -> str:
    native = next((r["bytes_per_token"] for r in rows if r["row"] == max_length.NATIVE), None)
    lines = ["| row | KiB / token kept for backward | beyond native |", "|---|---|---|"]
    for r in rows:
        beyond = f"{(r['bytes_per_token'] - native) / 1024:+.1f}" if native is not None else "-"
        lines.append(f"| {r['row']} | {r['bytes_per_token'] / 1024:.1f} | {beyond} |")
    for r in rows:
        lines.append(
            f"\n{r['row']}: bytes per token, by kind (where, dtype, made by, shape at the longer length, site)"
        )
        for k in r["kinds"]:
            lines.append(
                f"  {k['bytes_per_token']:9.0f}  {k['where']:5} {k['dtype']:8} {k['made_by']} "
                f"{tuple(k['shape_at_long'])}  {k['site']}"
            )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    max_length.model_arguments(p, hidden=256, layers=4, heads=4)
    p.add_argument("--lengths", nargs=2, type=int, default=[512, 1024], metavar=("SHORT", "LONG"))
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(gradient_checkpointing=False)  # its saved tensors are recomputed, not kept
    return p


def check_lengths_and_encodings(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The two-length benchmarks' checks (this one, :mod:`.peak_memory`), before any model loads:
    ``--lengths SHORT LONG`` with 2 <= SHORT < LONG, known ``--encodings``, and a model those
    encodings can patch (:func:`.model_check.check_model_arguments`); the names given."""
    short, long = args.lengths
    if not 2 <= short < long:
        p.error(f"--lengths {short} {long}: need 2 <= SHORT < LONG")
    from ...core.registry import list_encodings

    known = {info.name for info in list_encodings()}
    unknown = [n for n in args.encodings or [] if n not in known]
    if unknown:
        p.error(f"unknown encoding {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    check_model_arguments(p, args, args.encodings or sorted(known), max_positions=long)
    return list(args.encodings or [])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = check_lengths_and_encodings(parser(), args)
    if not names:
        from ...core.registry import list_encodings

        names = sorted(info.name for info in list_encodings())
    torch.set_num_threads(1)
    rows = [per_token(args, row) for row in [max_length.NATIVE, *names]]
    print(report(rows))
    if args.json:
        with replacing(args.json) as partial, open(partial, "w") as handle:
            json.dump({"settings": {k: v for k, v in vars(args).items()}, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
