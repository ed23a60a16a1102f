"""One rank of a head-parallel (Ulysses-layout) training step, compared with the one-process step.

Run by ``tests/attention/test_head_parallel.py`` as ``python -m torch.distributed.run
--nproc_per_node N tests/attention/head_parallel_worker.py OUT.json CASES.json``. Every rank builds
the same tiny patched model (the encoding's parameters perturbed per head, so a wrong head offset
changes the result), takes its T/N tokens of each sequence with their true position ids and the
labels shifted before sharding, and computes its part of the loss: the sum of the next-token
cross-entropies of its tokens over the count of all targets. Losses and gradients are summed over
the ranks (what DeepSpeed's gradient all-reduce does, up to its averaging factor). Rank 0 runs the
unsharded one-process step on the same model and writes both (loss, every gradient) to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_posenc
from hf_posenc.attention import chunked
from hf_posenc.recipes.tiny import tiny_model

DEFAULT_QUERY_BLOCK = chunked.QUERY_BLOCK


def build(family: str, encoding: str, params: dict, heads: int, kv_heads: int):
    """``params`` may also hold ``backend`` (patch_model's) and ``query_block`` (the block backends'
    queries per block, :data:`hf_posenc.attention.chunked.QUERY_BLOCK`, set for the whole process)."""
    params = dict(params)
    chunked.QUERY_BLOCK = params.pop("query_block", DEFAULT_QUERY_BLOCK)
    backend = params.pop("backend", "auto")
    model = tiny_model(family, vocab_size=64, hidden_size=64, num_heads=heads, num_kv_heads=kv_heads, seed=0)
    hf_posenc.patch_model(model, encoding, backend=backend, **params)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # per-head parameters made distinct (T5 tables and FoX gate weights start at 0)
        for parameter in model.posenc.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    for module in model.modules():  # dropout off: its random masks differ between sharded and whole runs
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.train()
    return model.float()


def loss_of(model, ids, positions, targets, total: int) -> torch.Tensor:
    logits = model(input_ids=ids, position_ids=positions).logits  # (B, T', V)
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        / total
    )


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    out_path, cases_path = sys.argv[1], sys.argv[2]
    cases = json.loads(Path(cases_path).read_text())
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        ids = torch.randint(3, 64, (2, case["length"]), generator=torch.Generator().manual_seed(2))
        positions = torch.arange(case["length"]).expand_as(ids)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]  # shifted before sharding: the last token of a shard has a target
        total = int((targets != -100).sum())
        shard = slice(rank * case["length"] // size, (rank + 1) * case["length"] // size)

        model = build(case["family"], case["encoding"], case["params"], case["heads"], case["kv_heads"])
        hf_posenc.enable_head_parallel(model)
        loss = loss_of(model, ids[:, shard], positions[:, shard], targets[:, shard], total)
        loss.backward()
        grads = gradients(model)
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        for grad in grads.values():
            dist.all_reduce(grad)
        if rank == 0:
            single = build(case["family"], case["encoding"], case["params"], case["heads"], case["kv_heads"])
            reference = loss_of(single, ids, positions, targets, total)
            reference.backward()
            expected = gradients(single)
            results.append(
                {
                    "case": case,
                    "loss": [float(summed), float(reference)],
                    "names": sorted(expected),
                    "parallel_names": sorted(grads),
                    "max_error": {
                        name: float((grads[name] - expected[name]).abs().max()) if name in grads else None
                        for name in expected
                    },
                    "scale": {name: float(expected[name].abs().max()) for name in expected},
                }
            )
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
