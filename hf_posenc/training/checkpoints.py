"""Atomic checkpoints: a run killed mid-save resumes from the previous complete one.

A checkpoint is written to ``checkpoint-N.tmp``, completed with ``trainer_state.json``,
then renamed to ``checkpoint-N`` (an atomic rename). Only complete directories — those
with the state file — are ever resumed from; leftovers of interrupted saves are removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
PREFIX = "checkpoint-"


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = []
    for path in output_dir.glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX) :]
        if suffix.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(suffix), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    complete = checkpoint_dirs(output_dir)
    return complete[-1] if complete else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Save model, optimizer, scheduler and RNG state for ``step`` atomically; prune old ones."""
    final = output_dir / f"{PREFIX}{step}"
    partial = output_dir / f"{PREFIX}{step}.tmp"
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state_path = partial / STATE_FILE
        state_path.write_text(json.dumps(state, indent=2))
        with open(state_path) as handle:
            os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old)
        for leftover in output_dir.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(leftover)
    accelerator.wait_for_everyone()
    return final
