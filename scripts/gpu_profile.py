"""Where a patched model's time goes on a GPU: torch.profiler over a few calls, top operators.

    python3 scripts/gpu_profile.py ENCODING MODE [--length T] [--freeze-encoding]

MODE: forward, train (forward+backward) or decode (one token at a time after a prompt of T).
The model is the bench's (Llama, hidden 1024, 16 heads of 64, 4 layers, vocab 32000, bf16).
Prints the 15 operators with the most self CUDA time and the 10 with the most self CPU time
(a decode step that is launch- or sync-bound shows there, not in CUDA time).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from hf_posenc import patch_model
from hf_posenc.compat import cache_keyword, output_cache
from hf_posenc.recipes.tiny import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("encoding")
    parser.add_argument("mode", choices=["forward", "train", "decode"])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--freeze-encoding", action="store_true")
    args = parser.parse_args()
    model = tiny_model(
        "llama", vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=16,
        max_positions=args.length + 64,
    )  # fmt: skip
    model = model.to(device="cuda", dtype=torch.bfloat16)
    if args.encoding != "native":
        model = patch_model(model, args.encoding)
        if args.freeze_encoding:
            model.posenc.requires_grad_(False)
    ids = torch.randint(0, 32000, (1, args.length), device="cuda")

    def step() -> None:
        if args.mode == "forward":
            with torch.no_grad():
                model(ids, use_cache=False)
        elif args.mode == "train":
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()
        else:
            from transformers import DynamicCache

            with torch.no_grad():
                out = model(ids, **{cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(8):
                        out = model(token, **{cache_keyword(model): output_cache(out)}, use_cache=True)
                        token = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                step.prof = prof  # type: ignore[attr-defined]

    model.train(args.mode == "train")
    step()
    step()  # compile and warm up
    torch.cuda.synchronize()
    if args.mode == "decode":
        step()
        prof = step.prof  # type: ignore[attr-defined]
    else:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    print(
        f"== {args.encoding} {args.mode} T={args.length}"
        + (" (encoding frozen)" if args.freeze_encoding else "")
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=70))


if __name__ == "__main__":
    main()
