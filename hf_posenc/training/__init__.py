"""Continued pretraining with accelerate: config, deterministic batches, atomic checkpoints."""

from .config import TrainConfig
from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
