"""The longest sequence one training step fits, for the native model and every encoding.

    python -m hf_posenc.recipes.benchmark.max_length --memory-gb 24 [--device cpu|cuda] \
        [--encodings rope alibi ...] [--family NAME] [--hidden-size 512] [--num-layers 8] \
        [--num-heads 8] [--vocab-size 32000] [--loss chunked] [--gradient-checkpointing] \
        [--backend auto] [--start 1024] [--limit 1048576] [--resolution 0.05]

One training step = forward, loss and backward of one sequence (batch 1) of a model built from
a config (random weights, nothing downloaded). For each row (``native``: the unpatched model
with its own RoPE; then each encoding with its defaults) the length doubles from ``--start``
until a step no longer fits ``--memory-gb``, then is bisected to ``--resolution`` (relative).
A step *fits* when it finishes and its peak memory is within the budget:

* CUDA: in this process, ``torch.cuda.max_memory_allocated`` over the step (an out-of-memory
  error is a miss), the allocator capped at the budget with ``set_per_process_memory_fraction``;
* CPU: each trial in a fresh subprocess, its peak resident set over the step (``VmHWM``, reset
  just before it) minus its resident set before the step (the model, Python and torch are not
  counted: the step's own activations, gradients and loss).

Reported per row: the maximum length, its ratio to native's, and the memory per token (the
slope of peak memory between the two longest lengths that fit). Prints a Markdown table and,
with ``--json FILE``, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch

from ...models import DEFAULT_FAMILY
from ..atomic import replacing
from .model_check import check_model_arguments

NATIVE = "native"


def _model(args: argparse.Namespace, name: str, length: int) -> Any:
    from ...core.patch import patch_model
    from ..tiny import tiny_model

    model: Any = tiny_model(
        args.family,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_heads,
        max_positions=max(length, 2),
    )
    if name != NATIVE:
        patch_model(model, name, backend=args.backend)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    return model.train()


def _step(args: argparse.Namespace, model: torch.nn.Module, length: int) -> None:
    from ..training.loss import loss_function

    ids = torch.randint(3, args.vocab_size, (1, length), device=args.device)
    loss = loss_function(args.loss, model)(model, {"input_ids": ids, "labels": ids, "use_cache": False})
    loss.backward()


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset this process's peak resident set (``VmHWM``) to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:  # not allowed here: the lifetime peak stays (an over-estimate, never an under-estimate)
        pass


def trial(args: argparse.Namespace, name: str, length: int) -> int | None:
    """Peak bytes of one training step at ``length``, or None when it does not fit."""
    budget = int(args.memory_gb * 2**30)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            model = _model(args, name, length)
            base = torch.cuda.memory_allocated()
            _step(args, model, length)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        except torch.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()
        return peak if peak <= budget else None
    command = [
        sys.executable,
        "-m",
        "hf_posenc.recipes.benchmark.max_length",
        "--trial",
        name,
        str(length),
        *args.forwarded,
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        return None
    peak = int(completed.stdout.strip().splitlines()[-1])
    return peak if peak <= budget else None


def longest(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Double, then bisect, the length of one training step within the budget."""
    fits: dict[int, int] = {}
    low, high, length = 0, None, args.start
    while length <= args.limit:
        peak = trial(args, name, length)
        if peak is None:
            high = length
            break
        fits[length], low, length = peak, length, length * 2
    while high is not None and low and (high - low) > args.resolution * low:
        middle = (low + high) // 2
        peak = trial(args, name, middle)
        if peak is None:
            high = middle
        else:
            fits[middle], low = peak, middle
    lengths = sorted(fits)
    per_token = None
    if len(lengths) >= 2:
        a, b = lengths[-2], lengths[-1]
        per_token = (fits[b] - fits[a]) / (b - a)
    return {
        "row": name,
        "max_length": low or None,
        "capped": high is None,  # still fitting at --limit
        "peak_bytes": fits.get(low),
        "bytes_per_token": per_token,
    }


def table(rows: list[dict[str, Any]]) -> str:
    native = next((r["max_length"] for r in rows if r["row"] == NATIVE), None)
    lines = ["| row | max length | x native | bytes / token |", "|---|---|---|---|"]
    for r in rows:
        length = "none fits" if r["max_length"] is None else f"{r['max_length']}{'+' if r['capped'] else ''}"
        ratio = f"{r['max_length'] / native:.2f}" if native and r["max_length"] else "-"
        per_token = f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] is not None else "-"
        lines.append(f"| {r['row']} | {length} | {ratio} | {per_token} |")
    return "\n".join(lines)


def _model_flags(args: argparse.Namespace) -> list[str]:
    """The flags a CPU trial subprocess needs to build the same model and step."""
    flags = [
        "--family",
        args.family,
        "--vocab-size",
        str(args.vocab_size),
        "--hidden-size",
        str(args.hidden_size),
    ]
    flags += ["--num-layers", str(args.num_layers), "--num-heads", str(args.num_heads), "--dtype", args.dtype]
    flags += ["--device", args.device, "--backend", args.backend, "--loss", args.loss]
    return flags + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])


def model_arguments(p: argparse.ArgumentParser, hidden: int, layers: int, heads: int) -> None:
    """The options that choose the encodings and the model one training step is measured on
    (shared with :mod:`.saved_memory`); ``hidden``, ``layers``, ``heads``: their defaults."""
    p.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    p.add_argument("--family", default=DEFAULT_FAMILY)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=hidden)
    p.add_argument("--num-layers", type=int, default=layers)
    p.add_argument("--num-heads", type=int, default=heads)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--loss", default="chunked", choices=["full", "chunked"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(p, hidden=512, layers=8, heads=8)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--memory-gb", type=float, default=24.0, help="budget of one step's peak memory")
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--limit", type=int, default=1 << 20, help="stop doubling here")
    p.add_argument("--resolution", type=float, default=0.05, help="relative precision of the bisection")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--trial", nargs=2, default=None, metavar=("ROW", "LENGTH"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.trial is not None:  # a CPU trial in its own process: print the step's peak bytes
        torch.set_num_threads(1)
        name, length = args.trial[0], int(args.trial[1])
        model = _model(args, name, length)
        before = _status_bytes("VmRSS")
        _reset_peak()  # the step's own peak, not the imports' or the model build's
        _step(args, model, length)
        print(_status_bytes("VmHWM") - before)
        return 0
    if args.start < 2 or args.limit < args.start or not 0 < args.resolution < 1 or args.memory_gb <= 0:
        parser().error("need --start >= 2, --limit >= --start, 0 < --resolution < 1, --memory-gb > 0")
    from ...core.registry import list_encodings

    names = args.encodings or [info.name for info in list_encodings()]
    known = {info.name for info in list_encodings()}
    unknown = [n for n in names if n not in known]
    if unknown:
        parser().error(f"unknown encoding {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    check_model_arguments(parser(), args, names, max_positions=args.start)
    args.forwarded = _model_flags(args)
    rows = []
    for name in [NATIVE, *names]:
        rows.append(longest(args, name))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        with replacing(args.json) as partial, open(partial, "w") as handle:
            json.dump(
                {"settings": {k: v for k, v in vars(args).items() if k != "forwarded"}, "rows": rows},
                handle,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
