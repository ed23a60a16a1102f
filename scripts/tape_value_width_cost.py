"""TAPE's attention at twice the head width, alone: one layer's fused CPU backward over values
[v | stream] with q and k zero-padded to their width, against an explicit per-head chain with q and
k at their own width (only the values doubled), and native's fused forward+backward at the head
width; each alternating, mean of 3 calls after one (B=1, 8 heads of 32, T=2048, fp32).

    python scripts/tape_value_width_cost.py [--length 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    heads, length, dim, rows = 8, args.length, 32, 256
    width, scale, log2e = 2 * dim, dim**-0.5, math.log2(math.e)
    q, k = torch.randn(1, heads, length, dim), torch.randn(1, heads, length, dim)
    values = torch.randn(1, heads, length, width)  # [v | stream]
    grad = torch.randn(1, heads, length, width)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, torch.zeros_like(x)), -1)

    out, lse = FORWARD(padded(q), padded(k), values, 0.0, True, scale=scale)

    def fused() -> None:
        BACKWARD(grad, padded(q), padded(k), values, out, lse, 0.0, True, scale=scale)

    def chain() -> None:  # FlashAttention-2's backward by hand, per head and block of rows
        delta = (grad[0] * out[0]).sum(-1)  # (H, T)
        grad_k, grad_v = torch.zeros(heads, length, dim), torch.zeros(heads, length, width)
        grad_q = torch.empty(heads, length, dim)
        causal = torch.full((rows, rows), -math.inf).triu_(1)
        for h in range(heads):
            for start in range(0, length, rows):
                stop = start + rows
                s = torch.mm(q[0, h, start:stop], k[0, h, :stop].T).mul_(scale * log2e)
                s.sub_(lse[0, h, start:stop, None] * log2e)[:, start:].add_(causal)
                s.exp2_()  # P
                grad_v[h, :stop].addmm_(s.T, grad[0, h, start:stop])
                dp = torch.mm(grad[0, h, start:stop], values[0, h, :stop].T).sub_(delta[h, start:stop, None])
                s.mul_(dp)  # dS
                torch.mm(s, k[0, h, :stop], out=grad_q[h, start:stop])
                grad_k[h, :stop].addmm_(s.T, q[0, h, start:stop])

    def native() -> None:
        o, m = FORWARD(q, k, values[..., :dim], 0.0, True, scale=scale)
        BACKWARD(grad[..., :dim], q, k, values[..., :dim], o, m, 0.0, True, scale=scale)

    cases = {"fused backward at twice the width": fused, "explicit chain, values doubled": chain}
    cases["native forward+backward"] = native
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(3):
                fn()
            times[name].append((time.perf_counter() - start) / 3 * 1e3)
    for name, values_ms in times.items():
        print(f"{name:36s} {min(values_ms):7.1f} ms (min of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
