"""DeepSpeed Ulysses in ``hf-posenc train --sequence-parallel N``: the batches, the loss and the
attention of one run whose ranks split each sequence (through accelerate's
``ParallelismConfig(sp_backend="deepspeed")``).

DeepSpeed's layout (``deepspeed.runtime.sequence_parallel.parallel_state_sp``): the ranks
``g*N .. g*N+N-1`` form sequence-parallel group ``g``; the groups are the data-parallel ranks.
Every rank of a group trains on the *same* sequences, each on its ``T/N`` consecutive tokens:

* the batch order is keyed by the data-parallel rank (the group, :func:`ulysses_layout`), so a
  resumed run, or a run on another number of groups with the same global batch, sees the same
  blocks, exactly as without sequence parallelism (:mod:`.batches`);
* each rank keeps its tokens of ``input_ids``, their true ``position_ids`` and the labels shifted
  *before* sharding (the target of token t is token t+1, the sequence's last token has none), cut
  as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cuts them (:func:`sequence_shard`). We slice here
  instead of passing a DataLoader through the adapter: the adapter gathers one batch from each
  rank of a group and returns them over N consecutive micro-steps, which would tie the batch of a
  micro-step to the group's ranks and not to the step (our resume and N-process equivalence rest
  on :class:`~.batches.BatchOrder`), and the loop feeds the model without a DataLoader;
* a patched model attends head-parallel over DeepSpeed's sequence-parallel group
  (:func:`hf_posenc.enable_head_parallel`: each rank ``Hq/N`` heads over all ``T`` tokens, every
  per-head encoding parameter at the rank's head offset); a native model attends through
  DeepSpeed's own Ulysses attention, which accelerate installs;
* each rank's loss is its tokens' summed cross-entropy over the target count of its group's whole
  micro-batch (``num_items_in_batch``). DeepSpeed divides it by the accumulation steps and
  all-reduces the gradients over all ranks divided by the number of groups, so the update is the
  gradient of the mean over the step's targets: the one-process step. (Exact because every
  micro-batch of every group holds ``B x (T-1)`` targets; packing, which breaks that, is refused.)
  The loss a rank holds is a part of its group's; the logged loss sums the parts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import InvalidParameterError

IGNORE = -100  # transformers' ignore_index


def ulysses_layout(process_index: int, num_processes: int, degree: int) -> tuple[int, int, int]:
    """(data-parallel size, data-parallel rank, sequence-parallel rank) of a process, as DeepSpeed
    groups consecutive ranks (``parallel_state_sp.initialize_sequence_parallel``)."""
    if degree < 1 or num_processes % degree:
        raise InvalidParameterError(
            f"--sequence-parallel {degree} is not allowed with {num_processes} processes; allowed: a degree "
            "dividing the number of processes"
        )
    return num_processes // degree, process_index // degree, process_index % degree


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) next-token targets: target t = label t+1, -100 for the last token."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]


def sequence_shard(inputs: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, Any]:
    """The model keywords of rank ``rank`` of ``size`` for one unsharded micro-batch.

    ``inputs``: ``input_ids`` (B, T), ``labels`` (B, T), optionally ``position_ids`` (B, T). Returns
    the rank's tokens ``rank*T/size .. (rank+1)*T/size - 1`` of ``input_ids``, ``position_ids``
    (explicit: ``0 .. T-1`` when absent) and of the labels shifted before sharding, under both
    ``shift_labels`` (read by transformers' loss instead of shifting) and ``labels`` (a loss is
    computed only when labels are given); ``num_items_in_batch`` is the target count of the whole
    micro-batch, so each rank's loss is its summed cross-entropy divided by it."""
    ids = inputs["input_ids"]  # (B, T)
    batch, length = ids.shape
    if length % size:
        raise InvalidParameterError(
            f"--sequence-parallel {size}: a sequence of {length} tokens is not allowed; allowed: a multiple of {size}"
        )
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(batch, length)
    targets = shifted_labels(inputs["labels"])
    chunk = length // size
    cut = slice(rank * chunk, (rank + 1) * chunk)
    own = targets[:, cut].contiguous()
    return {
        "input_ids": ids[:, cut].contiguous(),
        "position_ids": positions[:, cut].contiguous(),
        "labels": own,
        "shift_labels": own,
        "num_items_in_batch": int((targets != IGNORE).sum()),
    }


#: transformers attention implementations DeepSpeed's Ulysses wraps (accelerate's list)
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def configure_deepspeed(accelerator: Any, config: Any, model: Any, patched: bool) -> None:
    """Before ``accelerator.prepare``: the DeepSpeed settings accelerate cannot take from a DataLoader
    (we pass none) or that the loop owns, and the attention DeepSpeed's registration expects.

    * ``train_micro_batch_size_per_gpu`` = ``--batch-size`` (accelerate asks for it here when no
      DataLoader is prepared), ``gradient_accumulation_steps`` = ``--grad-accum``;
    * ``gradient_clipping`` = ``--max-grad-norm``: DeepSpeed clips in its own step (accelerate's
      ``clip_grad_norm_`` only reads the norm under DeepSpeed);
    * the model's attention implementation must be the one DeepSpeed wraps: a native model's is
      used as it is (refused when DeepSpeed cannot wrap it, e.g. ``eager``); a patched model attends
      in hf_posenc (never through transformers' registry) and is set to ``sdpa``, the one transformers
      builds the plain causal mask for."""
    settings = accelerator.state.deepspeed_plugin.deepspeed_config
    settings["train_micro_batch_size_per_gpu"] = config.batch_size
    settings["gradient_accumulation_steps"] = config.grad_accum
    settings["gradient_clipping"] = float(config.max_grad_norm)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA
    current = getattr(inner.config, "_attn_implementation", None)
    if patched:
        inner.config._attn_implementation = "sdpa"
        current = "sdpa"
    elif current not in ULYSSES_ATTENTION:
        raise InvalidParameterError(
            f"--sequence-parallel with a native model attending with {current!r} is not allowed: DeepSpeed's "
            f"Ulysses wraps {', '.join(ULYSSES_ATTENTION)}; allowed: one of them (or --encoding)"
        )
    accelerator.parallelism_config.sp_handler.sp_attn_implementation = current


#: ZeRO stages whose 2-process runs equal the one-process run (CPU, DeepSpeed 0.19.8: losses within
#: 1e-6, weights within 1e-5 after 4 steps). ZeRO-3's first difference (no weight decay: the optimizer
#: groups read the partitioned placeholders' shapes) is fixed in model_setup.full_shape; with it
#: alibi, FoX with --eval-every and the native model with checkpointing match under ZeRO-3, but with
#: --grad-accum 2 the step-3 loss (clipping on) or the final weights (clipping off) still differ, and
#: LoRA's merged weights differ by more than 5e-5. Not traced further inside DeepSpeed, so stage 3 is refused.
ZERO_STAGES = (0, 1, 2)


def check_zero_stage(accelerator: Any, degree: int) -> None:
    """Refuse, before the model loads, a DeepSpeed ZeRO stage not tested with Ulysses here."""
    plugin = accelerator.state.deepspeed_plugin
    stage = (plugin.deepspeed_config.get("zero_optimization") or {}).get("stage", plugin.zero_stage)
    if stage not in ZERO_STAGES:
        raise InvalidParameterError(
            f"--sequence-parallel {degree} with DeepSpeed ZeRO stage {stage} is not allowed (its runs differ from "
            "one process); allowed: zero_stage 0, 1 or 2 in the launch config (recipes/accelerate/ulysses.yaml)"
        )


def enable_sequence_parallel(accelerator: Any, model: Any, degree: int) -> Any:
    """After ``accelerator.prepare``: check that DeepSpeed's sequence-parallel group is the one
    :func:`ulysses_layout` assumed, and switch a patched model's head-parallel attention on over it.
    Returns that group (None for a native model, which DeepSpeed's own attention serves)."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ...core.head_parallel import enable_head_parallel
    from ...core.patch import patch_info

    group = parallel_state_sp.get_sequence_parallel_group()
    expected = ulysses_layout(accelerator.process_index, accelerator.num_processes, degree)[2]
    if dist.get_world_size(group) != degree or dist.get_rank(group) != expected:
        from .guards import LaunchError

        raise LaunchError(
            f"DeepSpeed's sequence-parallel group puts process {accelerator.process_index} at rank "
            f"{dist.get_rank(group)} of {dist.get_world_size(group)}; the batches were laid out for rank "
            f"{expected} of {degree} (consecutive processes per group)"
        )
    inner = accelerator.unwrap_model(model)
    if patch_info(inner) is None:
        return None
    enable_head_parallel(inner, group)
    return group


@contextlib.contextmanager
def whole_sequences(accelerator: Any, model: Any, group: Any) -> Iterator[None]:
    """Inside: a patched model attends every head over the tokens each rank passes (validation
    gives every rank whole held-out sequences); head-parallel over ``group`` again after. A native
    model needs nothing: accelerate registers DeepSpeed's Ulysses attention with
    ``disable_in_eval``, so it attends whole sequences in eval mode. ``group`` None: nothing changes."""
    if group is None:
        yield
        return
    from ...core.head_parallel import disable_head_parallel, enable_head_parallel

    inner = accelerator.unwrap_model(model)
    disable_head_parallel(inner)
    try:
        yield
    finally:
        enable_head_parallel(inner, group)


def deepspeed_launched() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")
