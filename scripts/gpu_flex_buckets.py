"""Compiled FlexAttention at length buckets on a GPU: compilations per length, the first call's
time (the compile) against a warm call, and bucketed == exact-shape values and gradients.

    python3 scripts/gpu_flex_buckets.py [--encodings alibi t5 fire fox] [--lengths 8000 8192 7900 9000]
        [--dtype bfloat16] [--check-length 300] [--device cuda] [--mode buckets|dynamic]

Part 1, per encoding (a random 2-layer Llama, hidden 256, 4 heads: head_dim 64, batch 1,
``--dtype``, ``backend="flex"``): forward+backward at each length in turn; prints the wall
seconds of the first call (compilation + run) and of a second call (run), and torch's count of
compiled graphs after them. Within a bucket the count does not move (8000, 7900 and 8192 share
the bucket 8192; 9000 is the next one, 10240).
Part 2, per encoding in fp32 at ``--check-length`` (not a bucket length; batch 2, one row
left-padded): logits and every
gradient with buckets against ``FLEX_BUCKETS_PER_OCTAVE = 0`` (each length compiled at its own
shape): the largest absolute differences (expected <= 1e-5).
``--mode dynamic``: the same with ``FLEX_DYNAMIC`` (``torch.compile(dynamic=True)``, no padding,
one graph for every length): compare its warm-call times with the buckets' run (on CPU its
padding-mask kernel does not build, so part 2 falls back to chunked there).
``--device cpu`` is a dry run (forward only: FlexAttention has no CPU backward; compiled through
``COMPILE_OFF_CUDA``; slow, use small lengths such as ``--lengths 200 250 --check-length 150``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's hf_posenc
import hf_posenc  # noqa: E402
import hf_posenc.attention.flex as flex  # noqa: E402


def model(name: str, dtype: torch.dtype, device: str, max_positions: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
    )
    patched = hf_posenc.patch_model(LlamaForCausalLM(config), name, backend="flex")
    with torch.no_grad():  # off the initial values (a zero table would make the bias trivial)
        for parameter in patched.posenc.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return patched.to(device=device, dtype=dtype)


def step(
    net: torch.nn.Module, ids: torch.Tensor, train: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits (and, when ``train``, the loss's backward into every parameter's .grad)."""
    if not train:
        with torch.no_grad():
            return net(ids, attention_mask=mask).logits
    net.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    out = net(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach()


def synced_seconds(*call) -> float:
    """Wall seconds of ``step(*call)``, the device synchronised before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(*call)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compile_counts(args: argparse.Namespace, train: bool) -> None:
    dtype = getattr(torch, args.dtype)
    for name in args.encodings:
        torch._dynamo.reset()
        counters.clear()
        net = model(name, dtype, args.device, max(args.lengths) + 1)
        for length in args.lengths:
            ids = torch.randint(3, 256, (1, length), device=args.device)
            first = synced_seconds(net, ids, train)
            second = synced_seconds(net, ids, train)
            graphs = counters["stats"]["unique_graphs"]
            print(
                f"{name:8s} T={length:6d} bucket={flex.bucket_length(length):6d} first {first:7.2f} s"
                f"  second {second:7.3f} s  compiled graphs so far: {graphs}",
                flush=True,
            )


MODES = {"buckets": (4, False), "dynamic": (4, True), "exact": (0, False)}


def configure(mode: str) -> None:
    """FlexAttention compiled at length buckets, with dynamic shapes, or at each exact shape."""
    flex.FLEX_BUCKETS_PER_OCTAVE, flex.FLEX_DYNAMIC = MODES[mode]


def exactness(args: argparse.Namespace, train: bool) -> None:
    length = args.check_length
    ids = torch.randint(3, 256, (2, length), device=args.device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 left-padded: the padding-mask block mask
    for name in args.encodings:
        results = {}
        for mode in (args.mode, "exact"):
            configure(mode)
            net = model(name, torch.float32, args.device, length + 1)
            logits = step(net, ids, train, mask)
            grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            results[mode] = (logits, grads)
        configure(args.mode)
        (tried, tried_grads), (exact, exact_grads) = results.values()
        grad_diff = max(
            ((tried_grads[n] - g).abs().max().item() for n, g in exact_grads.items()), default=0.0
        )
        print(
            f"{name:8s} fp32 T={length} {args.mode} (bucket {flex.bucket_length(length)}) against exact "
            f"shapes: logits max |diff| {(tried - exact).abs().max().item():.2e}, gradients "
            f"({len(exact_grads)}) max |diff| {grad_diff:.2e}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", nargs="+", default=["alibi", "t5", "fire", "fox"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[8000, 8192, 7900, 9000])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--check-length", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--mode",
        default="buckets",
        choices=["buckets", "dynamic"],
        help="dynamic: FLEX_DYNAMIC (dynamic=True)",
    )
    args = parser.parse_args()
    configure(args.mode)
    train = args.device.startswith("cuda")
    if not train:
        flex.COMPILE_OFF_CUDA = True  # the compiled path on CPU (forward only)
        flex.FLEX_MIN_QUERIES = 16
    print(f"torch {torch.__version__}, device {args.device}, FlexAttention compiled with {args.mode}")
    compile_counts(args, train)
    exactness(args, train)


if __name__ == "__main__":
    main()
