"""Training speed of LongLoRA's S2-Attn against full attention, paired on one model.

    python -m hf_posenc.recipes.benchmark.s2_attn --lengths 2048 8192 [--group-size 0.25] \
        [--hidden-size 512 --num-layers 8 --num-heads 8 --vocab-size 32000] [--batch-size 1] \
        [--rounds 5] [--device cuda --dtype bfloat16] [--json s2.json]

One RoPE-patched model of ``--family`` built from a config (no download); for each length, ``--rounds`` rounds of
one forward+backward step with full attention and one with S2-Attn, alternated (so machine load
hits both alike), after one warm-up step of each. Reported per length and mode: the median step
time, tokens per second, and on CUDA the step's peak allocated memory; and the ratio
full / S2 of the median times (> 1: S2-Attn is faster). Writes nothing but ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from ...models import DEFAULT_FAMILY
from ..atomic import replacing
from .model_check import check_model_arguments


def _step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """One forward+backward (the loss of ``ids`` on itself); seconds, synchronised on CUDA."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import hf_posenc

    from ..tiny import tiny_model

    dtype = getattr(torch, args.dtype)
    built: torch.nn.Module = tiny_model(
        args.family,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads or args.num_heads,
        max_positions=max(args.lengths),
    )
    model = built.to(device=args.device, dtype=dtype)
    hf_posenc.patch_model(model, args.encoding, backend=args.backend)
    model.train()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, args.vocab_size, (args.batch_size, length), generator=generator).to(
            args.device
        )
        times: dict[str, list[float]] = {"full": [], "s2": []}
        peaks: dict[str, int] = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for mode in ("full", "s2"):
                if mode == "s2":
                    hf_posenc.enable_s2_attn(model, args.group_size)
                if ids.is_cuda:
                    torch.cuda.reset_peak_memory_stats()
                seconds = _step(model, ids)
                if ids.is_cuda:
                    peaks[mode] = torch.cuda.max_memory_allocated()
                hf_posenc.disable_s2_attn(model)
                if round_:
                    times[mode].append(seconds)
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        for mode in ("full", "s2"):
            rows.append(
                {
                    "length": length,
                    "mode": mode,
                    "median_s": medians[mode],
                    "tokens_per_s": args.batch_size * length / medians[mode],
                    "peak_bytes": peaks.get(mode),
                    "group_size": args.group_size if mode == "s2" else None,
                }
            )
        print(f"length {length}: full/S2 step time {medians['full'] / medians['s2']:.2f}x", flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--group-size", default="0.25", help="S2-Attn group: tokens, or a fraction of the length")
    p.add_argument("--encoding", default="rope", help="an encoding S2-Attn can wrap (LongLoRA: RoPE)")
    p.add_argument("--family", default=DEFAULT_FAMILY)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ...attention.shifted import ShiftedSparse

    settings = ShiftedSparse.of(args.group_size)  # one line for a bad group, before the model is built
    check_model_arguments(parser(), args, [args.encoding], max_positions=max(args.lengths))
    for length in args.lengths:
        settings.group(length)
    rows = measure(args)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with replacing(args.json) as partial, open(partial, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
