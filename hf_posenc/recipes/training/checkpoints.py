"""Atomic, checksummed checkpoints: a run killed mid-save, or a damaged checkpoint, resumes from
the latest complete and intact one.

A checkpoint is written to ``checkpoint-N.tmp``, completed with ``trainer_state.json`` (which
records the SHA-256 and size of every other file in it), then renamed to ``checkpoint-N`` (an
atomic rename). Only complete directories — those with the state file — are candidates;
leftovers of interrupted saves are removed. :func:`intact_checkpoint` verifies the candidates
newest first and reports each damaged one by path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .space import saving_together

STATE_FILE = "trainer_state.json"
PREFIX = "checkpoint-"


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Complete checkpoints (with their state file), oldest first."""
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
    return json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` of every file under ``directory`` but the state file."""
    return {
        path.relative_to(directory).as_posix(): {"sha256": file_digest(path), "bytes": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != STATE_FILE
    }


#: the key of the trainer state's checksum of itself (every other key, canonical JSON)
STATE_DIGEST = "state_sha256"


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of ``state`` without its own digest, as canonical JSON (sorted keys)."""
    body = {k: v for k, v in state.items() if k != STATE_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _state_problem(checkpoint: Path, state: dict[str, Any]) -> str | None:
    """What is wrong with the trainer state itself: its checksum, its step against the folder's,
    its losses against its step."""
    path = checkpoint / STATE_FILE
    if STATE_DIGEST in state and state[STATE_DIGEST] != state_digest(state):
        return f"{path} does not match its recorded SHA-256 (edited or damaged)"
    folder_step = int(checkpoint.name[len(PREFIX) :])
    if state["step"] != folder_step:
        return (
            f"{path} records step {state['step']!r} in the folder of step {folder_step} (edited or misplaced)"
        )
    losses = state["losses"]
    if not isinstance(losses, list) or (
        losses and (not isinstance(losses[-1], list) or losses[-1][0] != folder_step)
    ):
        return f"{path} records losses that do not end at step {folder_step}"
    return None


def verify(checkpoint: Path) -> str | None:
    """None if ``checkpoint`` is intact, else what is wrong with it (one line)."""
    try:
        state = read_state(checkpoint)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{checkpoint / STATE_FILE} is unreadable ({error})"
    if not isinstance(state, dict) or not {"step", "losses", "config"} <= set(state):
        return f"{checkpoint / STATE_FILE} is not a trainer state (no step/losses/config)"
    problem = _state_problem(checkpoint, state)
    if problem is not None:
        return problem
    recorded = state.get("files")
    if recorded is None:  # written before checkpoints recorded checksums: cannot be verified
        return None
    if not isinstance(recorded, dict) or not recorded:
        return f"{checkpoint / STATE_FILE} records no files"
    for name, expected in recorded.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {expected['bytes']} were saved (truncated?)"
        if file_digest(path) != expected["sha256"]:
            return f"{path} does not match its recorded SHA-256 (damaged)"
    return None


def intact_checkpoint(output_dir: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest complete checkpoint whose files match their checksums; each damaged one is reported."""
    for checkpoint in reversed(checkpoint_dirs(output_dir)):
        problem = verify(checkpoint)
        if problem is None:
            if "files" not in read_state(checkpoint):
                warn(f"[train] {checkpoint} records no checksums (an older hf_posenc): resuming unverified")
            return checkpoint
        warn(f"[train] skipping damaged checkpoint {checkpoint}: {problem}")
    return None


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Save model, optimizer, scheduler and RNG state for ``step`` atomically; prune old ones."""
    final = output_dir / f"{PREFIX}{step}"
    partial = output_dir / f"{PREFIX}{step}.tmp"
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    with saving_together(accelerator, partial, f"checkpoint {step}"):
        accelerator.save_state(str(partial))
    with saving_together(accelerator, partial, f"checkpoint {step}"):
        if accelerator.is_main_process:
            for path in partial.rglob("*"):
                if path.is_file():
                    _fsync(path)
            state = {**state, "files": checksums(partial)}
            state[STATE_DIGEST] = state_digest(state)
            state_path = partial / STATE_FILE
            state_path.write_text(json.dumps(state, indent=2), encoding="utf-8")
            _fsync(state_path)
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in checkpoint_dirs(output_dir)[:-keep]:
            shutil.rmtree(old)
        for leftover in output_dir.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(leftover)
    accelerator.wait_for_everyone()
    return final
