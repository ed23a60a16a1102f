"""Training throughput on variable-length documents: packing vs padding vs cross-document blocks.

    python -m hf_posenc.recipes.benchmark.packing --model DIR --data SRC [--encoding NAME] \
        [--seq-len 2048] [--batch-size 4] [--steps 10] [--backend auto] [--device cpu]

Three ways to feed the same documents to forward+backward+AdamW steps of one model, measured
alternately (one step of each in turn, so machine load hits all three alike):

``blocks``   today's default: the concatenated token stream cut into blocks, positions across
             documents, attention across documents (every token is a real token).
``packing``  the same blocks with positions restarting per document and attention kept inside
             each document (``train --packing``).
``padding``  one document per row, truncated to ``--seq-len`` and right-padded to the longest
             row of the batch (attention mask, padded labels ignored).

Reported: real (non-padding) tokens trained per second, each mode's median step time, and the
ratios packing/padding and packing/blocks. Writes nothing; prints one JSON object per mode
and a line of ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..training.batches import BatchOrder
from ..training.corpus import document_dataset, token_dataset, training_blocks
from ..training.feed import packed_inputs


def _padded_batches(tokens, seq_len: int, batch_size: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """One document per row (truncated to seq_len), right-padded to the batch's longest row."""
    rows = [torch.tensor(ids[:seq_len], dtype=torch.long) for ids in tokens["input_ids"] if len(ids) > 1]
    batches = []
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, row in enumerate(chunk):
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def _real_tokens(inputs: dict[str, torch.Tensor]) -> int:
    mask = inputs.get("attention_mask")
    return int(mask.sum()) if mask is not None else inputs["input_ids"].numel()


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from ...core.loading import load_model

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    cache = Path(args.cache_dir)
    blocks = training_blocks(args.data, tokenizer, args.seq_len, limit=args.max_documents, cache_dir=cache)
    documents = document_dataset(
        args.data, text_field="text", split="train", limit=args.max_documents, cache_dir=cache
    )
    tokens = token_dataset(documents, tokenizer, cache)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    order = BatchOrder(blocks, args.batch_size, 1, 0, seed=0)
    feeds: dict[str, list[dict[str, Any]]] = {
        "blocks": [
            {"input_ids": b, "labels": b} for b in (order.micro_batch(s) for s in range(args.steps + 1))
        ],
        "packing": [
            {**packed_inputs(blocks, order.indices(s)), "use_cache": False} for s in range(args.steps + 1)
        ],
        "padding": _padded_batches(tokens, args.seq_len, args.batch_size, pad_id)[: args.steps + 1],
    }
    device = torch.device(args.device)
    model: Any
    if args.encoding:
        model = load_model(args.model, args.encoding, {"backend": args.backend})
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times: dict[str, list[float]] = {mode: [] for mode in feeds}
    counts: dict[str, int] = dict.fromkeys(feeds, 0)
    for step in range(min(len(batches) for batches in feeds.values())):
        for mode, batches in feeds.items():
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batches[step].items()}
            if device.type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            model(**inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step > 0:  # the first step of each mode is warm-up
                times[mode].append(time.perf_counter() - begin)
                counts[mode] += _real_tokens(inputs)
    return [
        {
            "mode": mode,
            "steps": len(times[mode]),
            "median_step_s": statistics.median(times[mode]) if times[mode] else None,
            "real_tokens_per_s": counts[mode] / sum(times[mode]) if times[mode] else None,
        }
        for mode in feeds
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local directory (model + tokenizer) or hub id")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--data", nargs="+", required=True, metavar="SRC")
    parser.add_argument("--encoding", default=None, help="patch with this encoding (default: native)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per mode (after one warm-up)")
    parser.add_argument("--max-documents", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", default="posenc-bench-packing-cache")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seq_len < 2 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be >= 1, --seq-len >= 2")
    rows = measure(args)
    for row in rows:
        print(json.dumps(row))
    rate = {row["mode"]: row["real_tokens_per_s"] for row in rows}
    if all(rate.values()):
        print(
            f"packing/padding {rate['packing'] / rate['padding']:.2f}x, "
            f"packing/blocks {rate['packing'] / rate['blocks']:.2f}x (real tokens per second)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
