"""The Toeplitz path's attention alone against torch's fused causal SDPA call: a learned KERPLE-like
table (-r1 log(1 + r2 d), per head, with gradients) over one (B=1, 8 heads of 32) call, forward and
forward+backward, alternating in one process (this 2-core machine is noisy: compare within one run).

    python scripts/toeplitz_attention_cost.py --length 2048 --rounds 21
    python scripts/toeplitz_attention_cost.py --baseline old_toeplitz_backward.py

``--baseline`` adds a row whose backward is another ``toeplitz_backward.py`` (e.g. ``git show
REV:hf_posenc/attention/toeplitz_backward.py > old.py``), loaded beside this checkout's, with the
largest gradient difference between the two printed first.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

# the checkout this script is in, not whichever hf_posenc is installed
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_posenc.attention import toeplitz  # noqa: E402

HEADS, HEAD_DIM = 8, 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--baseline", type=pathlib.Path, default=None, help="another toeplitz_backward.py")
    args = p.parse_args()
    torch.manual_seed(0)
    length = args.length
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    distance = torch.arange(length, dtype=torch.float32)
    r1 = (torch.rand(HEADS, 1) + 0.5).requires_grad_()
    r2 = (torch.rand(HEADS, 1) + 0.1).requires_grad_()
    grad = torch.randn(1, HEADS, length, HEAD_DIM)
    buffers: dict = {}
    current = toeplitz.toeplitz_gradients
    backwards = {"toeplitz": current}
    if args.baseline is not None:
        spec = importlib.util.spec_from_file_location("hf_posenc.attention._baseline_backward", args.baseline)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        backwards["baseline"] = module.toeplitz_gradients

    def native(train: bool) -> tuple:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad) if train else ()

    def table_call(backward, train: bool) -> tuple:
        toeplitz.toeplitz_gradients = backward
        table = -r1 * torch.log1p(r2 * distance)  # (H, T)
        out = toeplitz.attend_toeplitz(q, k, v, table, length, HEAD_DIM**-0.5, 256, buffers=buffers)
        return torch.autograd.grad(out, (q, k, v, r1, r2), grad) if train else ()

    if "baseline" in backwards:
        ours, theirs = table_call(current, True), table_call(backwards["baseline"], True)
        print(
            f"largest gradient difference to the baseline: {max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)):.3g}"
        )
    for train in (False, True):
        calls = {"native": lambda train=train: native(train)}
        for name, backward in backwards.items():
            calls[name] = lambda backward=backward, train=train: table_call(backward, train)
        if not train:
            calls.pop("baseline", None)  # the same forward
        with torch.set_grad_enabled(train):
            for call in calls.values():
                call()
            seconds: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - start)
        base = statistics.median(seconds["native"])
        row = ", ".join(
            f"{n} {statistics.median(t) * 1e3:.1f} ms ({statistics.median(t) / base:.3f}x)"
            for n, t in seconds.items()
        )
        print(f"{'forward+backward' if train else 'forward'} T={length}: {row}")
    toeplitz.toeplitz_gradients = current


if __name__ == "__main__":
    main()
