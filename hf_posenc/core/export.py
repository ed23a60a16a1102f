"""``export_native``: a patched model as a plain transformers checkpoint, where one exists.

vLLM, SGLang and TGI serve plain transformers checkpoints. When a patched model computes exactly
what its family's native model computes under some configuration — ``rope`` with a scaling
transformers implements (written as ``rope_parameters``), RoPE/NoPE per layer on a family whose
config says which layers rotate (``no_rope_layers``), GPT-2's ``learned`` table (``wpe``) — the
export writes that configuration and the weights, with no ``posenc`` entry and no ``posenc.*``
tensor: ``AutoModelForCausalLM.from_pretrained`` loads it without hf_posenc. Which configurations
a family can express is the family adapter's answer (``FamilyAdapter.export_positions``).

Every export is verified before it is kept: the written folder is loaded back with plain
transformers and its logits on a probe input must equal the patched model's (atol 1e-5 in fp32).
Everything is written to a temporary folder beside the target and renamed into place only then,
so a refusal leaves nothing behind.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import PosencError
from .patch import MODULE_NAME, patch_info, unpatch_model
from .registry import adapter_for

#: tokens in the probe input that checks an export (at most the model's max_position_embeddings)
PROBE_LENGTH = 96
POSSIBLE = (
    "possible: the family's native RoPE with no scaling or a static one (linear, NTK, YaRN, Llama 3), RoPE/NoPE "
    "per layer on a family whose config has per-layer NoPE, GPT-2's own kind of position table; otherwise keep "
    "the checkpoint and load it with hf_posenc.from_pretrained"
)


class ExportError(PosencError, ValueError):
    """The model cannot be exported as a plain transformers checkpoint (or not to that folder)."""


def _layers(info: dict[str, Any], num_layers: int) -> list[tuple[str, str, dict[str, Any]]]:
    """One (native kind, encoding, params) per layer from ``patch_info``; the kind is the encoding's
    ``EncodingConfig.native_positions``."""
    from .registry import get_encoding

    if "parts" not in info["params"]:
        entries = [(info["encoding"], dict(info["params"]))] * num_layers
    else:
        parts = info["params"]["parts"]
        entries = [(parts[p]["encoding"], dict(parts[p]["params"])) for p in info["params"]["layers"]]
    return [(get_encoding(name).config_class.native_positions, name, params) for name, params in entries]


def check_target(directory: str | Path) -> Path:
    """The export folder: absent or empty; anything else is refused in one line."""
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"export: {str(out)!r} is not allowed: it exists and is not an empty folder; allowed: a new or empty folder"
        )
    return out


def _probe(model: nn.Module) -> torch.Tensor:
    config: Any = model.config
    limit = (
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
        or PROBE_LENGTH
    )
    length = max(2, min(PROBE_LENGTH, int(limit)))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, int(config.vocab_size), (2, length), generator=generator)


@torch.no_grad()
def export_native(model: nn.Module, directory: str | Path, *, atol: float = 1e-5) -> Path:
    """Write ``model`` (patched) to ``directory`` as a plain transformers checkpoint with the same
    logits; raises :class:`ExportError` in one line when no native configuration gives them (why,
    and what is possible) or when ``directory`` is not a new or empty folder. The model is unchanged."""
    from transformers import AutoModelForCausalLM

    out = check_target(directory)
    info = patch_info(model)
    if info is None:
        raise ExportError(
            "export: the model is not patched by hf_posenc, so it already is a plain transformers model; "
            "save it with model.save_pretrained"
        )
    adapter = adapter_for(model)
    config: Any = model.config
    layers = _layers(info, adapter.geometry(config).num_layers)
    tensors = {k: v.detach().clone() for k, v in getattr(model, MODULE_NAME).state_dict().items()}
    native = copy.deepcopy(model)
    unpatch_model(native)
    reason = adapter.export_positions(native, layers, tensors)
    described = info.get("pattern") or info["encoding"]
    if reason is not None:
        raise ExportError(
            f"export: {described} on {adapter.family} has no native transformers equivalent ({reason}); {POSSIBLE}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
    try:
        native.save_pretrained(staging)  # type: ignore[operator]  # a transformers PreTrainedModel
        loaded = AutoModelForCausalLM.from_pretrained(staging, dtype=next(model.parameters()).dtype).eval()
        ids = _probe(model)
        was_training = model.training
        model.eval()
        expected = model(ids).logits
        model.train(was_training)
        difference = float((loaded(ids).logits.float() - expected.float()).abs().max())
        tolerance = atol if expected.dtype == torch.float32 else max(atol, 2e-2)
        if not difference <= tolerance:
            raise ExportError(
                f"export: {described} on {adapter.family} has no exact native transformers equivalent (the native "
                f"model's logits differ by {difference:.3g} > {tolerance:g}); {POSSIBLE}"
            )
        if out.exists():
            out.rmdir()  # empty: checked above
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out
