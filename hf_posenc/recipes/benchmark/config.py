"""Settings of one ``hf-posenc bench`` run (no torch import: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ...models import DEFAULT_FAMILY


@dataclasses.dataclass
class BenchConfig:
    encodings: list[str]
    lengths: list[int] = dataclasses.field(default_factory=lambda: [512, 2048, 4096, 8192])
    modes: list[str] = dataclasses.field(default_factory=lambda: ["forward", "train", "decode"])
    #: lengths of the ``train`` mode (forward+backward); None: ``lengths``
    train_lengths: list[int] | None = None
    family: str = DEFAULT_FAMILY
    vocab_size: int = 32000  # a real tokenizer's size: the logits are part of the memory baseline
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    batch_size: int = 1
    repeats: int = 5
    warmup: int = 1
    decode_prompt: int = 2048
    decode_tokens: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "auto"
    #: train mode without the encoding's own parameters' gradients (learned tables frozen): the
    #: cost of learning them, measured against the same run's trainable rows
    freeze_encoding: bool = False

    @property
    def longest(self) -> int:
        """Positions the run's models are built for: the longest length, train length or
        decoded prompt."""
        return max([*self.lengths, *(self.train_lengths or []), self.decode_prompt + self.decode_tokens])
