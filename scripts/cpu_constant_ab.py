"""A/B a tuning constant of the library in one process: the bench's model (``hf-posenc bench``'s
defaults: Llama, hidden 256, 8 heads, 4 layers) patched with one encoding, one step timed with
the constant set to each value in turn, for several alternating rounds, so every value sees
the same machine state (this 2-core machine is noisy: compare values within one run only).

    python scripts/cpu_constant_ab.py --encoding fire --mode forward --length 4096 \\
        --constant hf_posenc.encodings.network_block:NETWORK_CHUNK --values 16384 32768

prints each value's step times (seconds, sorted) and median. It imports the hf_posenc of the
checkout it sits in (so a worktree's script times that worktree's code).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import sys
import time

# the checkout this script is in, not whichever hf_posenc is installed: it times the code beside it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import hf_posenc  # noqa: E402
from hf_posenc.recipes.benchmark.config import BenchConfig  # noqa: E402
from hf_posenc.recipes.benchmark.suite import _forward as bench_forward  # noqa: E402
from hf_posenc.recipes.benchmark.suite import _model as bench_model  # noqa: E402
from hf_posenc.recipes.benchmark.suite import _train_step as bench_train_step  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoding", required=True, help="an encoding name, or 'native'")
    p.add_argument("--mode", choices=("forward", "train"), default="forward")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument(
        "--constant", required=True, help="module:NAME, e.g. hf_posenc.attention.chunked:QUERY_BLOCK"
    )
    p.add_argument("--values", required=True, nargs="+", type=int)
    p.add_argument("--rounds", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    module_name, _, name = args.constant.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        print(f"--constant: no module {module_name!r} (expected module:NAME)", file=sys.stderr)
        return 2
    if not name or not hasattr(module, name):
        print(f"--constant: {module_name} has no attribute {name!r}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    # the bench's own model (its defaults: family, width, layers, heads)
    model = bench_model(BenchConfig(encodings=[args.encoding], vocab_size=args.vocab_size), args.length)
    if args.encoding != "native":
        hf_posenc.patch_model(model, args.encoding)
    ids = torch.randint(0, args.vocab_size, (1, args.length))

    def step() -> None:  # the bench's own timed calls
        (bench_forward if args.mode == "forward" else bench_train_step)(model, ids)

    original = getattr(module, name)
    times: dict[int, list[float]] = {value: [] for value in args.values}
    try:
        step()  # warm-up: first-call allocations and lazy imports
        for _ in range(args.rounds):
            for value in args.values:
                setattr(module, name, value)
                start = time.perf_counter()
                step()
                times[value].append(time.perf_counter() - start)
    finally:
        setattr(module, name, original)
    for value, seconds in times.items():
        print(
            f"{name}={value}: median {statistics.median(seconds):.3f} s  {[round(s, 3) for s in sorted(seconds)]}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
