"""Sequence / context parallelism through accelerate's ``ParallelismConfig``: what ``hf-posenc
train`` accepts, refused in one line otherwise.

``accelerate launch --config_file recipes/accelerate/cp_fsdp2.yaml`` (or ``sp_deepspeed.yaml``)
puts the parallel sizes in the environment (``PARALLELISM_CONFIG_CP_SIZE``, ``..._SP_SIZE``,
``..._SP_BACKEND``); they are read here before any model loads.

* Context parallelism (``cp_size > 1``, torch's ring attention over FSDP2) splits every sequence
  over the ranks and runs causal SDPA as ring attention. It drops attention masks (accelerate
  forces ``is_causal``), so only encodings whose attention is plain causal SDPA over positions
  are exact: those whose stages are at most ``embed``, ``layer_input`` and ``rotate`` (each acts
  on a token alone, from its position) and that keep no state
  (asked of the encoding, after it is built). Refused: no CUDA (torch's ring attention runs the
  flash / memory-efficient SDPA kernels), ``--packing`` and ``--position-sampling`` (they need
  masks) and a ``--seq-len`` not divisible by ``2 x cp_size`` (torch's load-balanced split). The
  loop shards each batch (``parallelism.context_parallel_shards``); not run on GPUs yet.
* Sequence parallelism with DeepSpeed Ulysses (``sp_size > 1``) would give each rank a slice of
  the heads: per-head encoding parameters (ALiBi slopes, T5/KERPLE/FIRE heads, FoX gates) need
  the rank's head offset, which hf_posenc does not pass: refused.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import InvalidParameterError

#: stages an encoding may run and still attend with plain causal SDPA under context parallelism:
#: each acts on every token alone from its position (sharded with the tokens)
PLAIN_SDPA_STAGES = frozenset({"embed", "layer_input", "rotate"})


def parallel_sizes(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The context/sequence parallel sizes ``accelerate launch`` passed (1 when none)."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return {"cp_size": 1, "sp_size": 1, "sp_backend": None}
    return {
        "cp_size": int(env.get("PARALLELISM_CONFIG_CP_SIZE", "1")),
        "sp_size": int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1")),
        "sp_backend": env.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed"),
    }


def check_parallelism(
    config: Any, environ: dict[str, str] | None = None, *, cuda: bool | None = None
) -> None:
    """One line for a parallelism config this run cannot use (before any model loads)."""
    sizes = parallel_sizes(environ)
    if sizes["sp_size"] > 1:
        raise InvalidParameterError(
            f"sequence parallelism (sp_size={sizes['sp_size']}, sp_backend={sizes['sp_backend']!r}) is not "
            "supported by hf-posenc train: DeepSpeed Ulysses gives each rank a slice of the heads, and per-head "
            "encoding parameters would need the rank's head offset; allowed: sp_size 1 (see README, "
            "'Sequence and context parallelism')"
        )
    cp = sizes["cp_size"]
    if cp <= 1:
        return
    if config.packing or config.position_sampling != "none":
        what = "--packing" if config.packing else f"--position-sampling {config.position_sampling}"
        raise InvalidParameterError(
            f"context parallelism (cp_size={cp}) with {what} is not allowed: CP drops attention masks; "
            "allowed: plain blocks with their own positions"
        )
    if config.seq_len % (2 * cp):
        raise InvalidParameterError(
            f"--seq-len {config.seq_len} is not divisible by 2 x cp_size = {2 * cp} (torch's load-balanced "
            f"context-parallel split); allowed: a multiple of {2 * cp}"
        )
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise InvalidParameterError(
            f"context parallelism (cp_size={cp}) needs CUDA GPUs (torch's ring attention runs the flash / "
            "memory-efficient SDPA kernels); this machine has none; allowed: cp_size 1"
        )
    # supported: the loop passes accelerate a ParallelismConfig and shards each micro-batch
    # (hf_posenc.recipes.training.parallelism); the encodings are checked there


def check_context_parallel_encoding(posenc: Any, cp_size: int) -> None:
    """Refuse an encoding whose attention is not plain causal SDPA under context parallelism."""
    if cp_size <= 1 or posenc is None:
        return
    parts = posenc.encodings() if hasattr(posenc, "encodings") else [posenc]
    for part in parts:
        extra = sorted(set(part.active_stages()) - PLAIN_SDPA_STAGES)
        if extra or part.stateful:
            reason = f"stages {', '.join(extra)}" if extra else "state carried across the sequence"
            raise InvalidParameterError(
                f"context parallelism is not allowed with encoding {part.name!r} ({reason}): ring attention runs "
                "plain causal SDPA without masks or biases; allowed: encodings whose stages are at most "
                "embed, layer_input and rotate"
            )
