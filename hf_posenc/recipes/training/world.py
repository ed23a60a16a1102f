"""The world of processes one training run holds, before and around its steps: the accelerator
(the process group with its ``--ddp-timeout``, the sequence engine, the trackers), the output
folder's lock and checks, the resume point (the newest intact checkpoint with the same
settings, on the token stream its steps trained on) and the state restored from it. Used by :mod:`.loop`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError
from .. import run_lock
from .checkpoints import intact_checkpoint, read_state
from .config import TrainConfig
from .guards import check_output_dir, check_world, launch_notes, resume_differences, use_cpu_for_a_gpu_launch
from .parallelism import launch_degrees


def make_accelerator(config: TrainConfig, output_dir: Path):
    from datetime import timedelta

    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from .parallelism import parallelism_config

    # the world size from the launcher's environment: asking accelerate's state would start the
    # process group before the Accelerator below, without its timeout
    degrees = launch_degrees(config.context_parallel, config.sequence_parallel)
    sequence_engine = parallelism_config(*degrees, int(os.environ.get("WORLD_SIZE", "1")), config.seq_len)
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=config.ddp_timeout))
    if degrees[1] > 1 and not torch.cuda.is_available():
        # accelerate starts DeepSpeed's process group with the backend of a found accelerator; on CPU
        # processes it finds none and would run each process alone: name the device and gloo
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        group = InitProcessGroupKwargs(backend="gloo", timeout=group.timeout)
    return Accelerator(
        parallelism_config=sequence_engine,
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        kwargs_handlers=[group],
        log_with=list(config.report_to) or None,
        project_dir=str(output_dir),
    )


def open_accelerator(config: TrainConfig, output_dir: Path, *, resume: bool, overwrite: bool):
    """The accelerator of one world of processes, after the output directory is checked."""
    # DeepSpeed Ulysses runs its engine on CPU processes too (gloo); accelerate's CPU switch would drop it
    ulysses = launch_degrees(config.context_parallel, config.sequence_parallel)[1] > 1
    on_cpu = False if ulysses else use_cpu_for_a_gpu_launch()
    accelerator = make_accelerator(config, output_dir)
    check_world(accelerator)
    if accelerator.is_main_process:
        for note in launch_notes(accelerator, on_cpu):
            print(note)
    hold_output_dir(accelerator, output_dir)  # before --overwrite may remove anything
    check_output_dir(output_dir, resume=resume, overwrite=overwrite, is_main=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    return accelerator


def hold_output_dir(accelerator, output_dir: Path) -> None:
    """The main process takes the output folder's lock; every process of the launch raises the
    same one-line :class:`FolderInUseError` when another run holds it."""
    refusal = None
    if accelerator.is_main_process:
        try:
            run_lock.acquire(output_dir, "train run")
        except run_lock.FolderInUseError as error:
            refusal = str(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise run_lock.FolderInUseError(refusal)


def resume_point(config: TrainConfig, accelerator, output_dir: Path) -> Path:
    """The newest intact checkpoint of the run in ``output_dir``, whose settings must be ours."""
    warn = print if accelerator.is_main_process else (lambda _: None)
    checkpoint = intact_checkpoint(output_dir, warn=warn)
    if checkpoint is None:
        raise FileNotFoundError(
            f"--resume: no complete checkpoint (none intact) in {str(output_dir)!r}; each damaged one is named "
            "above: restore it from a copy, or start the run again with --overwrite"
        )
    changed = resume_differences(read_state(checkpoint)["config"], dataclasses.asdict(config))
    if changed:
        raise InvalidParameterError(
            f"--resume: settings differ from the run in {str(output_dir)!r}: " + ", ".join(changed)
        )
    return checkpoint


class DataChangedError(InvalidParameterError):
    """A resume on another token stream than the one its checkpoint trained on (``change``: the
    two streams, :func:`describe_data_change`)."""

    def __init__(self, message: str, checkpoint: Path, change: str) -> None:
        super().__init__(message)
        self.checkpoint, self.change = checkpoint, change


def data_fingerprint(blocks: Any) -> dict[str, Any] | None:
    """The token stream's fingerprint (:attr:`.corpus.TokenBlocks.fingerprint`), or None for
    blocks that have none (a caller's own in-memory blocks)."""
    return getattr(blocks, "fingerprint", None)


def check_resumed_data(checkpoint: Path, current: dict[str, Any] | None) -> None:
    """Refuse, in one line, to resume ``checkpoint`` on another token stream than the one its
    steps trained on (a data file edited, replaced or extended since the run started: the
    settings name the same files, the tokens are not the same). A checkpoint written before
    the fingerprint was recorded is not checked."""
    recorded = read_state(checkpoint).get("data")
    if recorded is None or current is None or recorded == current:
        return
    change = describe_data_change(recorded, current)
    raise DataChangedError(
        f"--resume: the training data is not what {checkpoint} trained on: {change}, so a data file changed "
        "since the run started; restore it, or start the run again with --overwrite",
        checkpoint,
        change,
    )


def describe_data_change(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """``N tokens in D documents (SHA-256 ...) then, ... now``."""
    return (
        f"{recorded['tokens']} tokens in "
        f"{recorded['documents']} documents (SHA-256 {recorded['sha256'][:12]}...) then, {current['tokens']} "
        f"tokens in {current['documents']} documents (SHA-256 {current['sha256'][:12]}...) now"
    )


def restore_state(accelerator, checkpoint: Path) -> tuple[int, list[tuple[int, float]]]:
    """Load model, optimizer, scheduler and RNG states; the step and loss history to go on from."""
    try:
        accelerator.load_state(str(checkpoint))
    except Exception as error:  # a file that passed its checksum but does not load
        raise InvalidParameterError(f"--resume: cannot load {checkpoint}: {error}") from error
    state = read_state(checkpoint)
    if accelerator.is_main_process:
        print(f"[train] resuming from {checkpoint} (step {state['step']})")
    return state["step"], [tuple(x) for x in state["losses"]]
