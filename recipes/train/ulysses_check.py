"""One training step of a patched tiny model under DeepSpeed Ulysses through accelerate, against the
one-process step: the engine itself (accelerate's ``ParallelismConfig(sp_backend="deepspeed")``,
DeepSpeed's sequence-parallel groups, its data adapter that shards each batch along the sequence,
its gradient all-reduce) with hf_posenc's head-parallel attention switched on over DeepSpeed's
sequence-parallel group. Runs on CPU processes (DeepSpeed falls back to gloo) or GPUs:

    ACCELERATE_USE_DEEPSPEED=true python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        recipes/train/ulysses_check.py alibi OUT.json

Each rank's loss is the sum of its tokens' next-token cross-entropies over the count of targets of
the whole batch, so the gradients DeepSpeed all-reduces are those of the one-process loss. Rank 0
writes the summed loss, the one-process loss and the largest gradient difference per tensor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hf_posenc
from hf_posenc.recipes.tiny import tiny_model

LENGTH, VOCAB = 16, 64


def build(encoding: str) -> torch.nn.Module:
    """The tiny Llama of every rank, its per-head encoding parameters made distinct (seeded)."""
    model = tiny_model("llama", vocab_size=VOCAB, hidden_size=64, num_heads=4, num_kv_heads=2, seed=0)
    hf_posenc.patch_model(model, encoding)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.posenc.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.config._attn_implementation = "sdpa"  # what DeepSpeed's Ulysses registration wraps
    return model.train().float()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, total: int) -> torch.Tensor:
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten(), ignore_index=-100, reduction="sum") / total


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from deepspeed.utils import groups

    encoding, out = sys.argv[1], Path(sys.argv[2])
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(LENGTH).expand_as(ids)
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length=LENGTH, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
    )
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=0, gradient_accumulation_steps=1),
    )

    def collate(rows: list) -> dict[str, torch.Tensor]:
        batch = torch.stack([row[0] for row in rows])
        return {
            "input_ids": batch,
            "position_ids": torch.stack([row[1] for row in rows]),
            "labels": batch.clone(),
        }

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids, positions), batch_size=2, collate_fn=collate
    )
    model = build(encoding)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inner = accelerator.unwrap_model(engine)
    hf_posenc.enable_head_parallel(inner, groups._get_sequence_parallel_group())

    batch = next(iter(loader))  # this rank's T/N tokens, their positions, labels shifted before sharding
    total = int(ids.shape[0] * (LENGTH - 1))
    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = loss_sum(logits, batch["shift_labels"], total)
    engine.backward(loss)  # DeepSpeed's all-reduce (no optimizer step: the gradients stay readable)
    summed = loss.detach().clone()
    torch.distributed.all_reduce(summed)
    if torch.distributed.get_rank() == 0:
        single = build(encoding)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        reference = loss_sum(single(input_ids=ids, position_ids=positions).logits, targets, total)
        reference.backward()
        parallel = dict(inner.named_parameters())
        errors = {
            name: float((parallel[name].grad - p.grad).abs().max())
            if parallel[name].grad is not None
            else None
            for name, p in single.named_parameters()
            if p.grad is not None
        }
        out.write_text(
            json.dumps({"encoding": encoding, "loss": [float(summed), float(reference)], "errors": errors})
        )


if __name__ == "__main__":
    main()
