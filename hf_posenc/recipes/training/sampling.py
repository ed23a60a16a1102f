"""Position sampling: train short windows with the position ids of a longer target length.

``pose``        PoSE (Zhu et al. 2024, "PoSE: Efficient Context Window Extension of LLMs via
                Positional Skip-wise Training", arXiv:2309.10400), as its released training code
                does it: the window of L tokens is cut into two chunks, the first of length
                ``l0 ~ U{1 .. ceil(L/2)}`` keeps positions ``0 .. l0-1``, the second is skipped
                forward by ``u ~ U{0 .. N-L}``: positions ``l0+u .. L-1+u``; every position is
                below the target length N, and the largest is ``L-1+u``.
``randomized``  Randomized positional encodings (Ruoss et al. 2023, "Randomized Positional
                Encodings Boost Length Generalization of Transformers", ACL): the L positions are
                a uniform sample without replacement from ``0 .. N-1``, sorted ascending.

Each sequence (with ``--packing`` each document piece) draws its own sample from a generator
seeded by the run's seed and the sequence's index in the whole run (the same on any number of
processes, and after a resume). Sampled ids are not contiguous, so the model gets an explicit
mask: all ones (2-D) without packing, the block-diagonal causal mask (4-D) with it —
transformers would otherwise read every skip as a document boundary.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InvalidParameterError

#: room for 2**40 sequences per seed in the generator seeds
_SEED_STRIDE = 1 << 40


def pose_positions(length: int, target: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) PoSE position ids of a window of ``length`` tokens for target length ``target``."""
    first = int(torch.randint(1, (length + 1) // 2 + 1, (1,), generator=generator))
    skip = int(torch.randint(0, target - length + 1, (1,), generator=generator))
    positions = torch.arange(length)
    positions[first:] += skip
    return positions


def randomized_positions(length: int, target: int, generator: torch.Generator) -> torch.Tensor:
    """(length,) sorted position ids drawn without replacement from ``0 .. target-1``."""
    return torch.randperm(target, generator=generator)[:length].sort().values


SAMPLERS = {"pose": pose_positions, "randomized": randomized_positions}


def sample_positions(
    kind: str, positions: torch.Tensor, target: int, seed: int, first_sequence: int
) -> torch.Tensor:
    """positions (B, L), restarting at 0 per document -> sampled position ids (B, L): each
    document piece of row b gets its own sample from the generator of sequence ``first_sequence + b``."""
    sampler = SAMPLERS[kind]
    out = positions.clone()
    for row in range(positions.shape[0]):
        generator = torch.Generator().manual_seed(seed * _SEED_STRIDE + first_sequence + row)
        starts = [*(positions[row] == 0).nonzero().flatten().tolist(), positions.shape[1]]
        for start, stop in zip(starts, starts[1:], strict=False):
            out[row, start:stop] = sampler(stop - start, target, generator)
    return out


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """positions (B, L) restarting at 0 per document -> (B, 1, L, L) bool: causal within a document."""
    documents = (positions == 0).cumsum(dim=1)  # (B, L): the document of each token
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return (same & causal)[:, None]


def check_encoding_reads_positions(kind: str, posenc: Any) -> None:
    """Refuse position sampling for a patch whose attention reads no position ids (asked of the
    encoding: ``Encoding.reads_position_ids``; a hybrid needs one part that reads them)."""
    if kind == "none" or posenc is None:
        return  # an unpatched model: its own (RoPE or learned) positions
    parts = posenc.encodings() if hasattr(posenc, "encodings") else [posenc]
    if not any(part.reads_position_ids() for part in parts):
        names = "+".join(part.name for part in parts)
        raise InvalidParameterError(
            f"--position-sampling {kind} is not allowed with encoding {names!r}: its attention reads no "
            "position ids (index distances, forget gates, contextual positions or none), so sampled ids "
            "would change nothing; allowed: an encoding that reads them (" + ", ".join(_readers()) + ")"
        )


def _readers() -> list[str]:
    """The registered encodings whose attention reads position ids (with their defaults)."""
    from ...core.registry import get_encoding, list_encodings

    return [info.name for info in list_encodings() if get_encoding(info.name).reads_positions]
