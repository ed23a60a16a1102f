"""Checks that keep a run from being lost or corrupted: the output folder, ``--resume``, the
process world of a launch, and finite losses and weights."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError, PosencError
from .checkpoints import PREFIX, checkpoint_dirs
from .config import TrainConfig

#: settings that may change between an interrupted run and its ``--resume`` (they do not
#: change what is trained: logging, checkpoint cadence, where caches live, trackers)
RESUMABLE_CHANGES = frozenset(
    {
        "output_dir",
        "log_every",
        "save_every",
        "keep_checkpoints",
        "ddp_timeout",
        "report_to",
        "data_cache",
        "num_proc",
        "threads",
        "eval_every",
        "eval_data",
        "eval_split",
        "eval_tokens",
    }
)


class TrainingError(PosencError, RuntimeError):
    """Training cannot go on (non-finite loss, a broken launch); nothing final was written."""


class LaunchError(TrainingError):
    """The processes of a multi-process launch do not form the world that was asked for."""


def check_output_dir(output_dir: Path, *, resume: bool, overwrite: bool, is_main: bool = True) -> None:
    """Create ``output_dir`` if needed; refuse to overwrite another run (finished or not).

    With ``overwrite`` the previous run's checkpoints and final model are removed (by the main
    process only)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output path {str(output_dir)!r} exists and is not a directory")
    if resume and overwrite:
        raise InvalidParameterError("--resume and --overwrite exclude each other; choose one")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise PermissionError(f"output directory {str(output_dir)!r} is not writable: {error}") from error
    finished = (output_dir / "final").exists()
    if finished and resume:
        raise InvalidParameterError(
            f"{str(output_dir / 'final')!r} exists: that run has finished, there is nothing to resume; "
            "pass --overwrite to train it again from the start, or choose another --output-dir"
        )
    if resume or not (finished or checkpoint_dirs(output_dir)):
        return
    if not overwrite:
        what = "a finished run (final/)" if finished else "checkpoints of an unfinished run"
        raise InvalidParameterError(
            f"{str(output_dir)!r} already holds {what}; pass --resume to continue an unfinished run, "
            "--overwrite to replace it, or choose another --output-dir (nothing was changed)"
        )
    if is_main:
        for old in [output_dir / "final", *output_dir.glob(f"{PREFIX}*")]:
            shutil.rmtree(old, ignore_errors=True)


def _canonical(config: dict[str, Any]) -> dict[str, Any]:
    from ...core.request import canonical_request

    values = dict(config)
    if values.get("encoding"):
        values["encoding"] = canonical_request(values["encoding"])
    return values


def resume_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key=new (was old)`` for each setting that differs from the interrupted run's."""
    # a setting added after the run was saved (e.g. packing) counts as its default
    defaults = {
        f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING
    }
    saved = {k: v for k, v in defaults.items() if k not in saved and k in current} | saved
    before, after = _canonical(saved), _canonical(current)
    keys = sorted((set(before) | set(after)) - RESUMABLE_CHANGES)
    return [f"{k}={after.get(k)!r} (was {before.get(k)!r})" for k in keys if before.get(k) != after.get(k)]


def use_cpu_for_a_gpu_launch() -> bool:
    """Under a multi-process launch (``WORLD_SIZE`` > 1) on a machine without CUDA, have accelerate
    join the processes on the CPU (gloo) instead of running each alone; True if it did.

    accelerate 1.x only does this with ``ACCELERATE_USE_CPU=true`` in the environment, which a
    YAML config cannot set: without it, a MULTI_GPU or FSDP config started N unconnected
    processes that each acted as the main one."""
    import torch

    launched = os.environ.get("WORLD_SIZE", "1")
    if not launched.isdigit() or int(launched) < 2 or torch.cuda.is_available():
        return False
    if "ACCELERATE_USE_CPU" in os.environ:  # the user decided
        return False
    os.environ["ACCELERATE_USE_CPU"] = "true"
    return True


def check_world(accelerator) -> None:
    """Stop before training if the launch asked for more processes than accelerate joined.

    ``torchrun``/``accelerate launch`` set ``WORLD_SIZE`` for each process it starts; when
    accelerate then runs each of them alone (a GPU config on a machine without GPUs, a CPU
    launch without ``--multi_gpu``), every process believes it is the main one and they would
    race on one output folder.
    """
    launched = os.environ.get("WORLD_SIZE")
    joined = accelerator.num_processes
    if launched is not None and launched.isdigit() and int(launched) != joined:
        rank = os.environ.get("RANK", "?")
        raise LaunchError(
            f"the launcher started {launched} processes (this is rank {rank}) but accelerate joined "
            f"{joined} (distributed_type={accelerator.distributed_type.value}); every process would act as "
            "the main one. On CPU launch with `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu "
            "--num_processes N` or recipes/accelerate/cpu_2proc.yaml; on GPUs check that CUDA is visible"
        )


def launch_notes(accelerator, on_cpu: bool) -> list[str]:
    """What a multi-process launch turned into, when that differs from what its config says."""
    notes = []
    kind = accelerator.distributed_type.value
    if on_cpu:
        notes.append(
            f"[train] no CUDA device: the {accelerator.num_processes} launched processes train on the CPU "
            f"(gloo, {kind})"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and kind != "FSDP":
        notes.append(
            f"[train] FSDP was asked for, but accelerate runs {kind} here (it shards with FSDP on GPU-type "
            "devices only): every process holds the whole model"
        )
    return notes


def check_finite_loss(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise TrainingError(
            f"loss is {loss} at step {step}: training diverged; stopped without writing final/ "
            "(lower --lr, use --dtype float32 or bfloat16, or keep --max-grad-norm > 0; "
            "--resume continues from the last checkpoint)"
        )


def check_finite_weights(accelerator, model, step: int) -> None:
    """Raise on every process if any process holds a non-finite weight (nothing is saved then)."""
    import torch

    bad = next((name for name, p in model.named_parameters() if not torch.isfinite(p.detach()).all()), None)
    flags = accelerator.gather(
        torch.tensor([bad is not None], dtype=torch.float32, device=accelerator.device)
    )
    if flags.max().item() > 0:
        where = f"parameter {bad}" if bad else "a parameter on another process"
        raise TrainingError(
            f"{where} holds non-finite values after step {step}: training diverged; stopped without "
            "saving (lower --lr; --resume continues from the last checkpoint)"
        )
