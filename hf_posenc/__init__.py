"""hf_posenc: switch the positional encoding of a pretrained Llama, Mistral or GPT-2 model.

import hf_posenc
hf_posenc.patch_model(model, "alibi")        # in place; returns the model
hf_posenc.unpatch_model(model)               # exact restore
with hf_posenc.patched(model, "t5"): ...     # temporary
hf_posenc.reconfigure(model, scaling={"type": "linear", "factor": 2.0})  # in place, tensors kept
hf_posenc.list_encodings()                   # names, aliases, parameters
model = hf_posenc.from_pretrained(directory) # reload a saved patched model
"""

__version__ = "0.1.0"

from . import encodings  # noqa: E402,F401  (registers every encoding)
from .config import EncodingConfig  # noqa: E402
from .encodings.alibi import ALiBiConfig  # noqa: E402
from .encodings.cape import CAPEConfig  # noqa: E402
from .encodings.comrope import ComRoPEConfig  # noqa: E402
from .encodings.cope import CoPEConfig  # noqa: E402
from .encodings.expe import ExPEConfig  # noqa: E402
from .encodings.exqpe import ExQPEConfig  # noqa: E402
from .encodings.fire import FIREConfig  # noqa: E402
from .encodings.fope import FoPEConfig  # noqa: E402
from .encodings.fox import FoXConfig  # noqa: E402
from .encodings.fox_pro import FoXProConfig  # noqa: E402
from .encodings.kerple import KERPLEConfig  # noqa: E402
from .encodings.learned import LearnedConfig  # noqa: E402
from .encodings.liere import LieREConfig  # noqa: E402
from .encodings.nope import NoPEConfig  # noqa: E402
from .encodings.rope import RoPEConfig  # noqa: E402
from .encodings.rope2d import RoPE2DConfig  # noqa: E402
from .encodings.sandwich import SandwichConfig  # noqa: E402
from .encodings.sba import SBAConfig  # noqa: E402
from .encodings.sinusoidal import SinusoidalConfig  # noqa: E402
from .encodings.t5 import T5Config  # noqa: E402
from .encodings.tape import TAPEConfig  # noqa: E402
from .errors import (  # noqa: E402
    AlreadyPatchedError,
    InvalidParameterError,
    NotPatchedError,
    PosencError,
    PositionRangeError,
    UnknownEncodingError,
    UnsupportedModelError,
)
from .loading import from_pretrained, load_model  # noqa: E402
from .patch import patch_info, patch_model, patched, unpatch_model  # noqa: E402
from .reconfigure import reconfigure  # noqa: E402
from .registry import EncodingInfo, list_encodings, supported_families  # noqa: E402

__all__ = [
    "__version__",
    "patch_model",
    "unpatch_model",
    "patched",
    "patch_info",
    "reconfigure",
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
    "PosencError",
    "UnknownEncodingError",
    "InvalidParameterError",
    "UnsupportedModelError",
    "AlreadyPatchedError",
    "NotPatchedError",
    "PositionRangeError",
]
