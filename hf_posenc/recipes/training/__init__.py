"""Continued pretraining with accelerate: config, deterministic batches, atomic checkpoints.

``TrainConfig`` imports nothing heavy; ``train`` (torch, accelerate) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import TrainConfig

if TYPE_CHECKING:
    from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]


def __getattr__(name: str) -> Any:
    if name in ("TrainResult", "train"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
