"""Which state this CPU is in, for reading a benchmark taken on it: the time of one (256 x 32) by
(32 x 2048) product split between torch's threads (the shape of one head's scores in FIRE's
training blocks), one batched over 4 heads (per head), and the same split product on one thread.

On the 2-vCPU VM of 2026-11-28 the split product read ~0.18 ms in some stretches of a few minutes
and ~0.35 ms (its one-thread time) in others, in the same process, while the batched one stayed at
~0.19 ms per head; FIRE's training, CoPE's and CAPE's paths read up to ~20 % slower against native
in the slow stretches (README, "The CPU ratio benchmark of issue 21"). Run it before and after a
benchmark, or with ``--seconds`` beside nothing else to watch the state change:

    python scripts/split_product_probe.py [--seconds 0] [--interval 2]
"""

from __future__ import annotations

import argparse
import time

import torch

ROWS, DIM, KEYS, HEADS = 256, 32, 2048, 4
#: a split product slower than this (ms) reads as the slow state
SLOW_MS = 0.28


def _ms(run, repeats: int = 40) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1e3


def probe() -> dict[str, float]:
    """Milliseconds per (256 x 2048) product: split between the threads, batched per head, one thread."""
    q, k = torch.randn(ROWS, DIM), torch.randn(KEYS, DIM)
    out = torch.empty(ROWS, KEYS)
    qs, ks = torch.randn(HEADS, ROWS, DIM), torch.randn(HEADS, KEYS, DIM)
    outs = torch.empty(HEADS, ROWS, KEYS)
    split = _ms(lambda: torch.mm(q, k.T, out=out))
    batched = _ms(lambda: torch.bmm(qs, ks.transpose(1, 2), out=outs), 10) / HEADS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _ms(lambda: torch.mm(q, k.T, out=out))
    finally:
        torch.set_num_threads(threads)
    return {"split": split, "batched": batched, "one_thread": single}


def state() -> str:
    """'fast' or 'slow': this machine's state now, by one :func:`probe` (the split product
    against :data:`SLOW_MS`)."""
    return "slow" if probe()["split"] > SLOW_MS else "fast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=0.0, help="keep probing this long (0: once)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between probes")
    args = parser.parse_args()
    end = time.time() + args.seconds
    while True:
        found = probe()
        state = "slow" if found["split"] > SLOW_MS else "fast"
        print(
            time.strftime("%H:%M:%S"),
            f"threads={torch.get_num_threads()}",
            " ".join(f"{name}={value:.3f}ms" for name, value in found.items()),
            state,
            flush=True,
        )
        if time.time() >= end:
            break
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
