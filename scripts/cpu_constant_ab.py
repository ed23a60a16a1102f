"""A/B a tuning constant of the library in one process: the bench's model (``hf-posenc bench``'s
defaults: Llama, hidden 256, 8 heads, 4 layers) patched with one encoding, one step timed with
the constant set to each value in turn, for several alternating rounds, so every value sees
the same machine state (this 2-core machine is noisy: compare values within one run only).

    python scripts/cpu_constant_ab.py --encoding fire --mode forward --length 4096 \\
        --constant hf_posenc.encodings.network_block:NETWORK_CHUNK --values 16384 32768

prints each value's step times (seconds, sorted) and median. With ``--native`` the unpatched
model (the same weights) takes a step in each round too, and each value's median is also given
as a ratio to native's; without ``--constant`` the encoding is timed as it is (against native,
with ``--native``). With ``--by-state`` every round starts with ``split_product_probe.py``'s probe
and the medians are also given per state of the machine it read (fast / slow; with ``--native``
as medians of each round's ratio to native's step). It imports the hf_posenc of the checkout it
sits in (so a worktree's script times that worktree's code).
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # split_product_probe, beside it

import split_product_probe  # noqa: E402  (beside this script)
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
    p.add_argument("--constant", help="module:NAME, e.g. hf_posenc.attention.chunked:QUERY_BLOCK")
    p.add_argument(
        "--values", nargs="+", type=int, default=[], help="the constant's values (with --constant)"
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--native", action="store_true", help="also time the unpatched model in every round")
    p.add_argument(
        "--by-state",
        action="store_true",
        help="probe the machine's state before each round (split_product_probe.py)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.constant is None) != (not args.values):
        print("--constant and --values go together (neither: the encoding as it is)", file=sys.stderr)
        return 2
    module, name = None, "as is"
    if args.constant is not None:
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
    # the bench's own model (its defaults: family, width, layers, heads); native keeps its weights
    config = BenchConfig(encodings=[args.encoding], vocab_size=args.vocab_size)
    model = bench_model(config, args.length)
    native = None
    if args.native:
        native = bench_model(config, args.length)
        native.load_state_dict(model.state_dict())
    if args.encoding != "native":
        hf_posenc.patch_model(model, args.encoding)
    ids = torch.randint(0, args.vocab_size, (1, args.length))

    def step(which) -> float:  # the bench's own timed calls
        start = time.perf_counter()
        (bench_forward if args.mode == "forward" else bench_train_step)(which, ids)
        return time.perf_counter() - start

    original = None if module is None else getattr(module, name)
    values: list[int | None] = list(args.values) or [None]
    times: dict[int | None, list[float]] = {value: [] for value in values}
    native_times: list[float] = []
    state_of = split_product_probe.state if args.by_state else None
    states: list[str] = []
    try:
        step(model)  # warm-up: first-call allocations and lazy imports
        if native is not None:
            step(native)
        for _ in range(args.rounds):
            if state_of is not None:
                states.append(state_of())
            if native is not None:
                native_times.append(step(native))
            for value in values:
                if module is not None:
                    setattr(module, name, value)
                times[value].append(step(model))
    finally:
        if module is not None:
            setattr(module, name, original)
    if native_times:
        print(
            f"native: median {statistics.median(native_times):.3f} s  {[round(s, 3) for s in sorted(native_times)]}"
        )
    for value, seconds in times.items():
        label = name if value is None else f"{name}={value}"
        ratio = (
            f" ({statistics.median(seconds) / statistics.median(native_times):.3f}x native)"
            if native_times
            else ""
        )
        print(
            f"{label}: median {statistics.median(seconds):.3f} s{ratio}  {[round(s, 3) for s in sorted(seconds)]}"
        )
    for state in sorted(set(states)):
        rounds = [i for i, found in enumerate(states) if found == state]
        for value, seconds in times.items():
            label = name if value is None else f"{name}={value}"
            if native_times:  # each round's own ratio: the state may change between rounds
                figure = f"{statistics.median(seconds[i] / native_times[i] for i in rounds):.3f}x native"
            else:
                figure = f"{statistics.median(seconds[i] for i in rounds):.3f} s"
            print(f"{state} state ({len(rounds)} of {len(states)} rounds): {label}: median {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
