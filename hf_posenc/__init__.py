"""hf_posenc: switch the positional encoding of a pretrained Transformers model (Llama, Mistral,
Qwen2, Qwen3, OLMo 2, Gemma 3, Phi-3, SmolLM3, GPT-2; `hf_posenc.supported_families()`).

import hf_posenc
hf_posenc.patch_model(model, "alibi")        # in place; returns the model
hf_posenc.unpatch_model(model)               # exact restore
with hf_posenc.patched(model, "t5"): ...     # temporary
hf_posenc.reconfigure(model, scaling={"type": "linear", "factor": 2.0})  # in place, tensors kept
hf_posenc.list_encodings()                   # names, aliases, parameters
model = hf_posenc.from_pretrained(directory) # reload a saved patched model
"""

from typing import TYPE_CHECKING

from . import _moved
from ._version import __version__
from .errors import (  # light: no torch
    AlreadyPatchedError,
    CheckpointError,
    InvalidParameterError,
    NotPatchedError,
    PosencError,
    PositionRangeError,
    UnknownEncodingError,
    UnsupportedModelError,
)

#: public name -> the submodule that defines it. Imported on first use (PEP 562), so
#: ``import hf_posenc`` (and ``hf-posenc --help``) does not pay for torch and transformers.
_EXPORTS = {
    "patch_model": "core.patch",
    "unpatch_model": "core.patch",
    "patched": "core.patch",
    "patch_info": "core.patch",
    "reconfigure": "core.reconfiguration",
    "export_native": "core.export",
    "enable_s2_attn": "core.shifted_sparse",
    "disable_s2_attn": "core.shifted_sparse",
    "s2_attn": "core.shifted_sparse",
    "enable_head_parallel": "core.head_parallel",
    "disable_head_parallel": "core.head_parallel",
    "head_parallel": "core.head_parallel",
    "from_pretrained": "core.loading",
    "load_model": "core.loading",
    "list_encodings": "core.registry",
    "supported_families": "core.registry",
    "EncodingInfo": "core.registry",
    "EncodingConfig": "core.config",
    "ALiBiConfig": "encodings.alibi",
    "CAPEConfig": "encodings.cape",
    "ComRoPEConfig": "encodings.comrope",
    "CoPEConfig": "encodings.cope",
    "ExPEConfig": "encodings.expe",
    "ExQPEConfig": "encodings.exqpe",
    "FIREConfig": "encodings.fire",
    "FoPEConfig": "encodings.fope",
    "FoXConfig": "encodings.fox",
    "FoXProConfig": "encodings.fox_pro",
    "KERPLEConfig": "encodings.kerple",
    "LearnedConfig": "encodings.learned",
    "LieREConfig": "encodings.liere",
    "NoPEConfig": "encodings.nope",
    "RoPEConfig": "encodings.rope",
    "ReRoPEConfig": "encodings.rerope",
    "LeakyReRoPEConfig": "encodings.rerope",
    "SelfExtendConfig": "encodings.selfextend",
    "RoPE2DConfig": "encodings.rope2d",
    "SandwichConfig": "encodings.sandwich",
    "SBAConfig": "encodings.sba",
    "SinusoidalConfig": "encodings.sinusoidal",
    "T5Config": "encodings.t5",
    "TAPEConfig": "encodings.tape",
    "XPosConfig": "encodings.xpos",
}


_moved.install()  # old import paths (hf_posenc.patch, hf_posenc.study, ...) for one release


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        moved = _moved.moved_attribute(name)
        if moved is not None:
            return moved
        raise AttributeError(f"module 'hf_posenc' has no attribute {name!r}")
    import importlib

    importlib.import_module(f"{__name__}.encodings")  # registers every encoding
    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what static checkers and IDEs see
    from .core.config import EncodingConfig
    from .core.export import export_native
    from .core.head_parallel import disable_head_parallel, enable_head_parallel, head_parallel
    from .core.loading import from_pretrained, load_model
    from .core.patch import patch_info, patch_model, patched, unpatch_model
    from .core.reconfiguration import reconfigure
    from .core.registry import EncodingInfo, list_encodings, supported_families
    from .core.shifted_sparse import disable_s2_attn, enable_s2_attn, s2_attn
    from .encodings.alibi import ALiBiConfig
    from .encodings.cape import CAPEConfig
    from .encodings.comrope import ComRoPEConfig
    from .encodings.cope import CoPEConfig
    from .encodings.expe import ExPEConfig
    from .encodings.exqpe import ExQPEConfig
    from .encodings.fire import FIREConfig
    from .encodings.fope import FoPEConfig
    from .encodings.fox import FoXConfig
    from .encodings.fox_pro import FoXProConfig
    from .encodings.kerple import KERPLEConfig
    from .encodings.learned import LearnedConfig
    from .encodings.liere import LieREConfig
    from .encodings.nope import NoPEConfig
    from .encodings.rerope import LeakyReRoPEConfig, ReRoPEConfig
    from .encodings.rope import RoPEConfig
    from .encodings.rope2d import RoPE2DConfig
    from .encodings.sandwich import SandwichConfig
    from .encodings.sba import SBAConfig
    from .encodings.selfextend import SelfExtendConfig
    from .encodings.sinusoidal import SinusoidalConfig
    from .encodings.t5 import T5Config
    from .encodings.tape import TAPEConfig
    from .encodings.xpos import XPosConfig

__all__ = [
    "__version__",
    "patch_model",
    "unpatch_model",
    "patched",
    "patch_info",
    "reconfigure",
    "export_native",
    "enable_s2_attn",
    "disable_s2_attn",
    "s2_attn",
    "enable_head_parallel",
    "disable_head_parallel",
    "head_parallel",
    "from_pretrained",
    "load_model",
    "list_encodings",
    "supported_families",
    "EncodingInfo",
    "EncodingConfig",
    "ALiBiConfig",
    "CAPEConfig",
    "ComRoPEConfig",
    "CoPEConfig",
    "ExPEConfig",
    "ExQPEConfig",
    "FIREConfig",
    "FoPEConfig",
    "FoXConfig",
    "FoXProConfig",
    "KERPLEConfig",
    "LearnedConfig",
    "LieREConfig",
    "NoPEConfig",
    "RoPEConfig",
    "RoPE2DConfig",
    "SBAConfig",
    "SandwichConfig",
    "SinusoidalConfig",
    "T5Config",
    "TAPEConfig",
    "ReRoPEConfig",
    "LeakyReRoPEConfig",
    "SelfExtendConfig",
    "XPosConfig",
    "PosencError",
    "UnknownEncodingError",
    "InvalidParameterError",
    "UnsupportedModelError",
    "AlreadyPatchedError",
    "NotPatchedError",
    "PositionRangeError",
    "CheckpointError",
]
