"""Steps per second of the default study's model at 1 vs N torch threads, paired on one machine.

Builds the model the default `hf-posenc study` trains (tiny Llama: hidden 128, 4 layers, 4 heads,
vocabulary 2048, RoPE), then alternates thread counts in rounds so that every count sees the
same machine load: per round and count, a few training steps (batch 16 x 128 tokens, AdamW,
forward + backward + step) and a few evaluation forwards at the study's longest length (2048
tokens). Prints the median seconds per step for each, the ratio to one thread, the load
average before and after, and the core count: the evidence behind `hf_posenc.recipes.threads`.

    OMP_NUM_THREADS= python recipes/study/threads_benchmark.py             # 1 vs 2 threads
    python recipes/study/threads_benchmark.py --threads 1 2 4 --rounds 5 --json threads.json

Run it on an idle machine for the README's figure (and once more under load to see the
difference); it downloads nothing and writes nothing unless --json is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def build_model(hidden_size: int, num_layers: int, vocab_size: int, max_positions: int):
    from hf_posenc.recipes.tiny import tiny_model

    model = tiny_model(
        "llama",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        max_positions=max_positions,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="thread counts compared")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every thread count once")
    parser.add_argument("--train-steps", type=int, default=5, help="training steps per round and count")
    parser.add_argument("--eval-steps", type=int, default=3, help="evaluation forwards per round and count")
    parser.add_argument("--batch-size", type=int, default=16, help="the study's default")
    parser.add_argument("--train-length", type=int, default=128, help="the study's default")
    parser.add_argument("--eval-length", type=int, default=2048, help="the study's longest (16x)")
    parser.add_argument("--hidden-size", type=int, default=128, help="the study's default")
    parser.add_argument("--num-layers", type=int, default=4, help="the study's default")
    parser.add_argument("--vocab-size", type=int, default=2048, help="the study's default")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import torch

    torch.manual_seed(0)
    model = build_model(args.hidden_size, args.num_layers, args.vocab_size, args.eval_length)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.train_length))
    eval_ids = torch.randint(0, args.vocab_size, (1, args.eval_length))

    def train_step() -> None:
        model.train()
        loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval_step() -> None:
        model.eval()
        model(input_ids=eval_ids, labels=eval_ids)

    load_before = os.getloadavg()[0]
    times: dict[int, dict[str, list[float]]] = {t: {"train": [], "eval": []} for t in args.threads}
    torch.set_num_threads(max(args.threads))
    train_step(), eval_step()  # warm-up: allocator, kernels
    for _ in range(args.rounds):
        for threads in args.threads:
            torch.set_num_threads(threads)
            train_step()  # one untimed step after switching
            for kind, step, count in (
                ("train", train_step, args.train_steps),
                ("eval", eval_step, args.eval_steps),
            ):
                for _ in range(count):
                    start = time.perf_counter()
                    step()
                    times[threads][kind].append(time.perf_counter() - start)
    load_after = os.getloadavg()[0]

    print(
        f"model: {parameters / 1e6:.2f} M parameters (hidden {args.hidden_size}, {args.num_layers} layers, "
        f"vocab {args.vocab_size}); cores: {os.cpu_count()}; load average (1 min) before {load_before:.2f}, "
        f"after {load_after:.2f}; torch {torch.__version__}"
    )
    print(
        f"{'threads':>7}  {'train s/step':>12}  {'steps/s':>8}  {'eval s/fwd':>10}  {'vs 1 thread (train, eval)':>26}"
    )
    base = {k: statistics.median(times[args.threads[0]][k]) for k in ("train", "eval")}
    summary = []
    for threads in args.threads:
        med = {k: statistics.median(times[threads][k]) for k in ("train", "eval")}
        ratio = f"{base['train'] / med['train']:.2f}x, {base['eval'] / med['eval']:.2f}x"
        print(
            f"{threads:>7}  {med['train']:>12.3f}  {1 / med['train']:>8.2f}  {med['eval']:>10.3f}  {ratio:>26}"
        )
        summary.append(
            {"threads": threads, "train_s_per_step": med["train"], "eval_s_per_forward": med["eval"]}
        )
    if args.json:
        record = {
            "parameters": parameters,
            "cores": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "settings": vars(args),
            "results": summary,
            "raw_seconds": {str(t): v for t, v in times.items()},
        }
        with open(args.json, "w") as file:
            json.dump(record, file, indent=2)


if __name__ == "__main__":
    main()
