"""FlexAttention alone on a GPU: which tiles and which way of learning a bias table run fastest.

    python3 scripts/gpu_flex_sweep.py [--length 8192] [--heads 16] [--head-dim 64] [--budget 240]

One attention call (B=1, causal, bf16, q/k/v requiring gradients) timed with CUDA events
(median of 10 after 3 warm-ups), against torch's SDPA (flash) in the same process:

- ``table``: the T5/KERPLE/Sandwich form, ``score + table[h, |i - j|]`` with an (H, T) fp32 table,
  forward under each tile rung (``--rungs``), frozen;
- ``table-learned``: the same with the table requiring a gradient (FlexAttention's captured-
  buffer gradient: one atomic add per score into the table), forward+backward per rung;
- ``future keys read entry 0``: the learned table indexed by max(i - j, 0) instead of |i - j|
  (the masked future keys' zero gradients all added into entry 0);
- ``alibi``: arithmetic ``-slope_h * (i - j)``, the bias with no load.

Prints one line per variant; a variant whose kernel does not build prints its error's first line.
Stops starting variants after ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

RUNGS = {
    "default": {},
    "m128n64s3w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "m128n64s2w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 2, "fwd_num_warps": 8},
    "m128n32s3w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 32, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "m64n64s3w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "tiles-64": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 2, "fwd_num_warps": 4},
}
BACKWARD_RUNGS = {
    "tiles-64": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                 "bwd_num_stages": 2, "bwd_num_warps": 4},
    "bwd64s2w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                  "bwd_num_stages": 2, "bwd_num_warps": 4},
    "bwd64s1w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                  "bwd_num_stages": 1, "bwd_num_warps": 8},
    "bwd32s3w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                  "bwd_num_stages": 3, "bwd_num_warps": 4},
}  # fmt: skip


def timed(function, repeats: int = 10) -> float:
    """Median milliseconds of ``function()`` (CUDA events) after three warm-ups."""
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--rungs", nargs="+", default=list(RUNGS))
    parser.add_argument("--backward-rungs", nargs="+", default=list(BACKWARD_RUNGS))
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 512
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    began = time.monotonic()
    T, H, D = args.length, args.heads, args.head_dim
    device = "cuda"
    q, k, v = (
        torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad_out = torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16)
    table = (torch.randn(H, T, device=device) * 0.1).requires_grad_(True)
    slopes = torch.rand(H, device=device) * 0.1
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    print(f"torch {torch.__version__} {torch.cuda.get_device_name(0)} T={T} H={H} D={D} bf16 causal")

    def native(backward: bool):
        def run():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if backward:
                out.backward(grad_out)

        return run

    def flex(score_mod, options, backward: bool):
        def run():
            out = compiled(q, k, v, score_mod=score_mod, block_mask=mask, kernel_options=options or None)
            if backward:
                out.backward(grad_out)

        return run

    base = {}
    for backward in (False, True):
        base[backward] = timed(native(backward))
        print(f"native sdpa {'fwd+bwd' if backward else 'fwd'}: {base[backward]:.3f} ms")

    def report(name: str, backward: bool, make) -> None:
        if time.monotonic() - began > args.budget:
            print(f"{name}: skipped (budget)")
            return
        started = time.monotonic()
        try:
            ms = timed(make())
        except Exception as error:  # noqa: BLE001 - a rung that does not build: say why, go on
            line = next(
                (s.strip() for s in str(error).splitlines() if "resource" in s), str(error).splitlines()[0]
            )
            print(f"{name}: failed {type(error).__name__}: {line[:200]}")
            return
        ratio = ms / base[backward]
        print(
            f"{name}: {ms:.3f} ms = {ratio:.2f}x native (built+timed in {time.monotonic() - started:.0f} s)"
        )

    def alibi(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki).to(torch.float32)

    frozen = table.detach()

    def table_frozen(score, b, h, qi, ki):
        return score + frozen[h, torch.abs(qi - ki)]

    def table_learned(score, b, h, qi, ki):
        return score + table[h, torch.abs(qi - ki)]

    def table_clamped(score, b, h, qi, ki):
        return score + table[h, torch.clamp(qi - ki, min=0)]

    report("alibi fwd default", False, lambda: flex(alibi, {}, False))
    report("alibi fwd+bwd default", True, lambda: flex(alibi, {}, True))
    for rung in args.rungs:
        report(f"table fwd {rung}", False, lambda rung=rung: flex(table_frozen, RUNGS[rung], False))
    for rung in args.backward_rungs:
        options = {**RUNGS["tiles-64"], **BACKWARD_RUNGS[rung]}
        report(f"table frozen fwd+bwd {rung}", True, lambda o=options: flex(table_frozen, o, True))
        report(f"table learned fwd+bwd {rung}", True, lambda o=options: flex(table_learned, o, True))
    options = {**RUNGS["tiles-64"], **BACKWARD_RUNGS["tiles-64"]}
    report(
        "table learned fwd+bwd tiles-64, future keys read entry 0",
        True,
        lambda: flex(table_clamped, options, True),
    )
    print(f"sweep took {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
