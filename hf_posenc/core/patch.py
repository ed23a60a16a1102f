"""Apply, record and undo a patch: ``patch_model``, ``unpatch_model``, ``patched``.

Patching is in place and fully reversible. Every change is recorded as an undo action:
the encoding module attached as ``model.posenc``, the forward pre-hook on the decoder
stack, the per-instance attention forwards, the neutralised native positions, the
attention implementation name, and ``config.posenc``. ``unpatch_model`` runs them in
reverse, leaving the model exactly as it was.

A per-layer hybrid (:mod:`hf_posenc.core.request`) is installed the same way: ``model.posenc`` holds
its parts, one pair of hooks serves them all, and each attention forward runs its layer's part.
What a request builds is worked out first, in :mod:`hf_posenc.core.plan`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from torch import nn

from ..attention import BACKENDS
from ..attention.forward import PatchedAttentionForward
from ..compat import (
    ATTN_IMPLEMENTATION,
    MASK_COMPATIBLE_IMPLEMENTATIONS,
    AcceptGenerateKeyword,
    GenerateCompilePolicy,
    get_attn_implementation,
    register_attention_implementation,
    set_attn_implementation,
)
from ..encodings.base import Encoding
from ..errors import AlreadyPatchedError, InvalidParameterError, NotPatchedError, UnsupportedModelError
from ..models.base import RestoreAttribute, Undo, replace_forward
from .config import EncodingConfig
from .hybrid import HybridEncoding
from .plan import BuiltPatch, build_patch
from .registry import adapter_for
from .request import EncodingRequest
from .runtime import PatchRuntime
from .saved_form import (  # noqa: F401  (MAPPING_KEYS, check_format_version: re-exported)
    HYBRID,
    MAPPING_KEYS,
    check_format_version,
    describe_patch,
    saved_description,
    saved_entry,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PATCH_ATTRIBUTE = "_hf_posenc_patch"
MODULE_NAME = "posenc"
CONFIG_KEY = "posenc"


@dataclasses.dataclass
class PatchRecord:
    """What ``unpatch_model``, ``reconfigure`` and ``patch_info`` need: the installed module, the
    plan's parts (a plain patch has one), the runtime and the undo actions.

    Stored on the model itself, and every undo action is an object that refers to the
    model's own modules (no closures), so ``copy.deepcopy``/pickling a patched model gives
    an independent patched model whose record points at the copy."""

    #: ``model.posenc``: the one part's encoding, or a hybrid's :class:`HybridEncoding`
    encoding: Encoding | HybridEncoding
    #: the parts' encoding modules and resolved configs, and the part of every layer
    parts: list[Encoding]
    configs: list[EncodingConfig]
    layers: list[int]
    runtime: PatchRuntime
    undo: list[Undo]

    @property
    def config(self) -> EncodingConfig:
        """The resolved config of the first part (a plain patch's only one)."""
        return self.configs[0]

    def names(self) -> list[str]:
        return [part.name for part in self.parts]

    def entry(self) -> dict[str, Any]:
        """The ``config.posenc`` entry of what runs now."""
        return saved_entry(self.names(), self.configs, self.layers)

    def describe(self) -> str:
        """The encoding's name, or a hybrid's per-layer text form (``hybrid rope*3+nope``)."""
        return describe_patch(self.names(), self.layers)


class PopModule:
    """Undo action: detach the encoding module."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self) -> None:
        self.owner._modules.pop(self.name, None)


class RestoreAttnImplementation:
    """Undo action: put back the attention implementation the model's config had."""

    def __init__(self, model: nn.Module, previous: str | None) -> None:
        self.model, self.previous = model, previous

    def __call__(self) -> None:
        set_attn_implementation(self.model.config, self.previous)


class RemoveConfigEntry:
    """Undo action: remove ``config.posenc`` from the model's (private) config."""

    def __init__(self, model: nn.Module, key: str) -> None:
        self.model, self.key = model, key

    def __call__(self) -> None:
        if hasattr(self.model.config, self.key):
            delattr(self.model.config, self.key)


class InitWeights:
    """Instance override of the model's ``_init_weights`` while patched: transformers'
    ``init_weights()`` (after ``to_empty()``, or for missing keys) would give the encoding's
    tensors generic Linear/Embedding inits; the encoding gets its own designed init instead
    (and, when patching rather than reloading, what ``initialise_from_model`` copies)."""

    def __init__(
        self, model: PreTrainedModel, encoding: Encoding | HybridEncoding, adapter: Any, initialise: bool
    ) -> None:
        self.model, self.encoding, self.adapter, self.initialise = model, encoding, adapter, initialise

    def __call__(self, module: nn.Module) -> None:
        if module is self.encoding:  # visited after its submodules
            # tensors loaded from a checkpoint (from_pretrained marks them) keep their values
            reset = self.encoding.reset_parameters(keep_loaded=True)
            if self.initialise and reset:
                self.encoding.initialise_from_model(self.model, self.adapter)
            return
        if any(module is m for m in self.encoding.modules()):
            return
        type(self.model)._init_weights(self.model, module)


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a wrapper: peft's ``PeftModel`` (``get_base_model()``), or
    ``model`` itself. The patch lives on this object."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        inner = get_base_model()
        if isinstance(inner, PreTrainedModel):
            return inner
    return model


def _own_config(model: nn.Module) -> None:
    """Give ``model`` (and every submodule that shares its config object) a private copy.

    transformers 5's ``from_config(other.config)`` makes two models share one config object;
    the patch writes ``_attn_implementation`` and ``config.posenc`` there, which would leak
    into the other model (and into what it saves). The copy is kept after unpatching, with
    the patch's entries removed, so changes a user made to it meanwhile are not lost."""
    shared = model.config
    private = copy.deepcopy(shared)
    for module in model.modules():
        if module.__dict__.get("config") is shared:
            module.config = private


def _model_dtype_device(model: PreTrainedModel) -> tuple[Any, Any]:
    embeddings = model.get_input_embeddings()
    return embeddings.weight.dtype, embeddings.weight.device


def patch_model(
    model: nn.Module,
    encoding: EncodingRequest,
    /,
    *,
    backend: str = "auto",
    **params: Any,
) -> nn.Module:
    """Switch ``model``'s positional encoding to ``encoding`` in place and return the model.

    ``model`` is any supported transformers model — a causal LM, a headless base model
    (``LlamaModel``), any head class — or a peft-wrapped one (the patch goes on the model
    inside). ``encoding`` is a name from :func:`list_encodings` (or an alias), an encoding
    config object (e.g. ``hf_posenc.ALiBiConfig()``), or the mapping stored in ``config.posenc``.
    ``params`` are the encoding's parameters. ``backend`` picks the attention backend:
    ``"auto"`` (default: ``"chunked"`` on CPU and FlexAttention/flash-attn on CUDA for the
    encodings whose bias comes in blocks, ``"sdpa"`` for the rest), ``"sdpa"`` (the whole
    bias as one float mask), ``"chunked"``, ``"flex"``, or ``"eager"`` (explicit scores; the
    reference). See ``hf_posenc/attention/core.py``.

    Per-layer hybrids (:mod:`hf_posenc.core.request`): a list is a pattern repeated over the depth
    (``["rope", "rope", "rope", "nope"]``, or the text ``"rope*3+nope"``); a mapping of layer
    indices gives each layer its encoding (``{"default": "rope", 3: "nope"}``). Entries are
    names, config objects or ``(name, params)`` pairs; ``params`` go to every entry that has them.
    """
    apply_patch(model, encoding, backend=backend, params=params, initialise=True)
    return model


def apply_patch(
    model: nn.Module,
    encoding: EncodingRequest,
    *,
    backend: str,
    params: Mapping[str, Any],
    initialise: bool,
) -> nn.Module:
    """:func:`patch_model`; ``initialise=False`` (reloading) skips ``initialise_from_model``
    (e.g. copying a native table), since the saved tensors are loaded next."""
    target = cast("PreTrainedModel", transformers_model(model))
    adapter = _check_patchable(target, backend)
    built = build_patch(target, adapter, encoding, params, backend)
    _place_module(target, built, adapter, initialise)
    undo: list[Undo] = []
    try:
        _install(target, built, adapter, initialise, undo)
    except BaseException:
        for action in reversed(undo):
            action()
        raise
    record = PatchRecord(built.module, built.parts, built.configs, built.layers, built.runtime, undo)
    setattr(target, PATCH_ATTRIBUTE, record)
    return model


def _check_patchable(target: PreTrainedModel, backend: str) -> Any:
    """The family adapter of ``target``; refuse a model that is unsupported, already patched or
    has a ``posenc`` attribute of its own, and an unknown backend."""
    adapter = adapter_for(target)  # only transformers models of a supported family
    adapter.check_supported(target)
    existing: PatchRecord | None = getattr(target, PATCH_ATTRIBUTE, None)
    if existing is not None:
        raise AlreadyPatchedError(
            f"this model is already patched with {existing.describe()!r}; "
            "call hf_posenc.unpatch_model(model) first"
        )
    if backend not in BACKENDS:
        raise InvalidParameterError(f"backend={backend!r} is not allowed; allowed: {', '.join(BACKENDS)}")
    if MODULE_NAME in target._modules or hasattr(type(target), MODULE_NAME):
        raise UnsupportedModelError(
            f"the model already has an attribute {MODULE_NAME!r}; cannot attach the encoding"
        )
    return adapter


def _place_module(target: PreTrainedModel, built: BuiltPatch, adapter: Any, initialise: bool) -> None:
    """Move the encoding module to the model's dtype and device, and (when patching rather than
    reloading) let it read what it starts from off the model."""
    dtype, device = _model_dtype_device(target)
    built.module.to(device=device, dtype=dtype)
    if initialise:
        built.module.initialise_from_model(target, adapter)


def _install(
    target: PreTrainedModel, built: BuiltPatch, adapter: Any, initialise: bool, undo: list[Undo]
) -> None:
    """Make every change of the patch, recording its undo action in ``undo`` as it goes."""
    _own_config(target)
    _attach_module(target, built, adapter, initialise, undo)
    _hook_decoder_stack(target, built.runtime, adapter, undo)
    undo.extend(adapter.neutralize_native_positions(target))
    _replace_attention_forwards(target, built, adapter, undo)
    _adapt_generation(target, built, undo)
    _select_attention_implementation(target, undo)
    setattr(target.config, CONFIG_KEY, built.entry)
    undo.append(RemoveConfigEntry(target, CONFIG_KEY))
    undo.append(built.runtime.reset)


def _attach_module(
    target: PreTrainedModel, built: BuiltPatch, adapter: Any, initialise: bool, undo: list[Undo]
) -> None:
    """``model.posenc``, and the model's ``_init_weights`` giving it its own designed init."""
    target.add_module(MODULE_NAME, built.module)
    undo.append(PopModule(target, MODULE_NAME))
    undo.append(RestoreAttribute(target, "_init_weights"))
    target._init_weights = InitWeights(target, built.module, adapter, initialise)  # type: ignore[method-assign]


def _hook_decoder_stack(
    target: PreTrainedModel, runtime: PatchRuntime, adapter: Any, undo: list[Undo]
) -> None:
    """The runtime's hooks on the decoder stack (and on the token embeddings for an ``embed`` stage):
    bound methods of the runtime, not closures, so copies of the model get their own runtime."""
    base = adapter.base_model(target)
    handle = base.register_forward_pre_hook(runtime.before_base_forward, with_kwargs=True, prepend=True)
    undo.append(handle.remove)
    undo.append(base.register_forward_hook(runtime.after_base_forward).remove)
    if "embed" in runtime.stages:
        undo.append(runtime.hook_embedding(target.get_input_embeddings()))


def _replace_attention_forwards(
    target: PreTrainedModel, built: BuiltPatch, adapter: Any, undo: list[Undo]
) -> None:
    """Each attention module runs its layer's part (per-instance forwards)."""
    for layer_idx, attention in enumerate(adapter.attention_modules(target)):
        part_runtime, encoding_layer = built.layer_runtimes[layer_idx]
        patched_forward = PatchedAttentionForward(attention, layer_idx, part_runtime, encoding_layer)
        undo.append(replace_forward(attention, patched_forward))


def _adapt_generation(target: PreTrainedModel, built: BuiltPatch, undo: list[Undo]) -> None:
    """What ``generate()`` must know of the parts: no compiled decoding for stateful encodings
    (and, on CUDA, for score-bias ones), the ``position_coordinates`` keyword accepted for those that take coordinates."""
    classes = [type(part) for part in built.parts]
    refusals = [refusal for cls in classes if (refusal := cls.compiled_decoding_refusal()) is not None]
    bias = any("score_bias" in cls.stages() for cls in classes)
    if (refusals or bias) and hasattr(type(target), "_valid_auto_compile_criteria"):
        # stateful encodings cannot run a compiled step; score-bias ones are not measured under
        # CUDA graphs since they failed there (README, Known differences)
        undo.append(GenerateCompilePolicy.install(target, refusals[0] if refusals else None, bias))
    if any(cls.takes_coordinates for cls in classes) and hasattr(type(target), "_validate_model_kwargs"):
        undo.append(AcceptGenerateKeyword.install(target, "position_coordinates"))


def _select_attention_implementation(target: PreTrainedModel, undo: list[Undo]) -> None:
    """The patched forwards read sdpa's boolean and eager's additive masks alike, so the user's
    choice stays visible (config._attn_implementation, output_attentions rules); other
    implementations (flash-attention's unpadded masks) get hf_posenc's, which builds sdpa-style masks."""
    previous_impl = get_attn_implementation(target.config)
    if previous_impl not in MASK_COMPATIBLE_IMPLEMENTATIONS:
        register_attention_implementation()
        undo.append(RestoreAttnImplementation(target, previous_impl))
        set_attn_implementation(target.config, ATTN_IMPLEMENTATION)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` exactly: outputs, state_dict keys, modules and config."""
    target = transformers_model(model)
    record: PatchRecord | None = getattr(target, PATCH_ATTRIBUTE, None)
    if record is None:
        raise NotPatchedError(f"{type(model).__name__} is not patched by hf_posenc; nothing to undo")
    for action in reversed(record.undo):
        action()
    delattr(target, PATCH_ATTRIBUTE)
    return model


@contextlib.contextmanager
def patched(model: nn.Module, encoding: EncodingRequest, /, **params: Any) -> Iterator[nn.Module]:
    """Context manager: the model is patched inside the block and restored after it."""
    patch_model(model, encoding, **params)
    try:
        yield model
    finally:
        unpatch_model(model)


def patch_info(model: nn.Module) -> dict[str, Any] | None:
    """``{'encoding': name, 'params': {...}}`` of a patched model, or None.

    A hybrid gives ``{'encoding': 'hybrid', 'pattern': 'rope*3+nope+...', 'params': {'parts':
    [{'encoding': ..., 'params': ...}, ...], 'layers': [part index per layer]}}``: the pattern
    and the part of every layer as they run. ``'kernels'``, once a fused kernel ran (FlexAttention on
    a GPU): what served each kind of call, e.g. ``{'cuda:0/bfloat16/d64/forward': 'flex (default)'}``
    (the kernel options' rung, or ``'chunked (...)'`` with what was tried)."""
    target = transformers_model(model)
    record: PatchRecord | None = getattr(target, PATCH_ATTRIBUTE, None)
    if record is None:
        return None
    entry = record.entry()
    info: dict[str, Any] = {"encoding": entry["encoding"]}
    if entry["encoding"] == HYBRID:
        info["pattern"] = saved_description(entry)
    info["params"] = entry["params"]
    kernels = {label: used for part in record.runtime.parts for label, used in part.kernel_choices.items()}
    if kernels:
        info["kernels"] = dict(sorted(kernels.items()))
    return info
