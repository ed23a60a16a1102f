"""TAPE's attention alone, one layer: values [v | stream] twice the head width, causal, fp32.
Each round times, in turn: native's fused CPU flash forward and backward at the head width;
the same kernel at twice the width with q and k zero-padded (TAPE's path to 2026-11-28); and the
blocked path TAPE takes now (``hf_posenc.attention.wide_values``: forward, backward with its
heads split over torch's threads, and the backward with every operation on all threads instead).
With ``--by-state`` each round is classified by ``scripts/split_product_probe.py`` (this VM's
fast and slow states) and the medians are given per state.

    python scripts/tape_value_width_cost.py [--length 2048] [--heads 8] [--head-dim 32] \
        [--rounds 10] [--by-state]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

# the checkout this script is in, not whichever hf_posenc is installed: it times the code beside it
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # split_product_probe, beside it

import split_product_probe  # noqa: E402  (beside this script)
import torch  # noqa: E402

from hf_posenc.attention import thread_split, wide_values  # noqa: E402

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--by-state", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    heads, length, dim = args.heads, args.length, args.head_dim
    scale = dim**-0.5
    q, k, v, stream = (torch.randn(1, heads, length, dim) for _ in range(4))
    values = torch.cat((v, stream), -1)  # (1, H, T, 2D)
    grad = torch.randn(1, heads, length, 2 * dim)
    wide_q, wide_k = (torch.cat((x, torch.zeros_like(x)), -1) for x in (q, k))
    out_native, lse_native = FORWARD(q, k, v, 0.0, True, scale=scale)[:2]
    out_wide, lse_wide = FORWARD(wide_q, wide_k, values, 0.0, True, scale=scale)[:2]
    flat = torch.empty(1, length, heads, 2 * dim)  # the stream path's layout: per token, per head
    outputs = [flat[..., :dim].transpose(1, 2), flat[..., dim:].transpose(1, 2)]
    lse = wide_values.forward(q, k, (v, stream), None, scale, outputs)
    grads = [grad[..., :dim], grad[..., dim:]]

    def blocked_backward() -> None:
        wide_values.backward(q, k, (v, stream), None, scale, outputs, grads, lse)

    def blocked_backward_one_part() -> None:
        with mock.patch.object(thread_split, "parts", lambda: 1):
            blocked_backward()

    cases: dict[str, Callable[[], object]] = {
        "native forward (width D)": lambda: FORWARD(q, k, v, 0.0, True, scale=scale),
        "native backward (width D)": lambda: BACKWARD(
            grad[..., :dim].contiguous(), q, k, v, out_native, lse_native, 0.0, True, scale=scale
        ),
        "fused forward, q/k padded to 2D": lambda: FORWARD(wide_q, wide_k, values, 0.0, True, scale=scale),
        "fused backward, q/k padded to 2D": lambda: BACKWARD(
            grad, wide_q, wide_k, values, out_wide, lse_wide, 0.0, True, scale=scale
        ),
        "blocked forward": lambda: wide_values.forward(q, k, (v, stream), None, scale, outputs),
        "blocked backward, heads split": blocked_backward,
        "blocked backward, ops threaded": blocked_backward_one_part,
    }
    for case in cases.values():
        case()
    state_of = split_product_probe.state if args.by_state else (lambda: "all")
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        state = state_of()
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times.setdefault(state, {}).setdefault(name, []).append((time.perf_counter() - start) * 1e3)
    print(
        f"one layer: {heads} heads of {dim}, values {2 * dim} wide, T={length}, {torch.get_num_threads()} threads"
    )
    for state, by_case in sorted(times.items()):
        print(f"{state} state ({len(next(iter(by_case.values())))} rounds), median ms:")
        for name, values_ms in by_case.items():
            print(f"  {name:36s} {statistics.median(values_ms):7.1f}")


if __name__ == "__main__":
    main()
