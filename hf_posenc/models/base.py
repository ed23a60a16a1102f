"""The interface of a model family: everything the engine needs to know about one, and
nothing about encodings.

A family is ONE module in ``hf_posenc/models/`` (its file name is the family's name) whose
adapter class is decorated with :func:`hf_posenc.models.register_family`. The adapter owns
every fact about the family; nothing outside ``models/`` names a family:

========================  ============================================================
what                      where on :class:`FamilyAdapter`
========================  ============================================================
which configs             ``model_types`` (``config.model_type`` values it serves)
refusing what it cannot   ``check_supported(model)``: one-line
patch                     :class:`~hf_posenc.errors.UnsupportedModelError` naming the
                          feature and its value (``refuse``), for every config or module
                          feature the adapter does not reproduce (q/k norms, logit
                          soft-capping, embedding multipliers, an attention class whose
                          forward it has not been written for, ...)
shapes, native settings   ``geometry(config)`` -> :class:`ModelGeometry` (model-wide
                          values and one :class:`LayerGeometry` per layer: rope theta,
                          native rotary on/off, sliding window, softmax scale)
where things are          ``base_model``, ``attention_modules``
q, k, v                   ``project(module, x_qk, x_v)``: the family's projections *with*
                          their biases and q/k norms, as the native forward applies them
                          before positions enter (before RoPE)
output                    ``output(module, attn)``, ``dropout_p(module)``
native positions          ``neutralize_native_positions(model)`` (reversible),
                          ``native_position_table(model)`` (learned tables),
                          ``native_position_limit(config)`` (the unpatched model's limit)
LoRA                      ``lora_targets``, ``lora_fan_in_fan_out``
head                      ``plain_lm_head``: logits are ``lm_head(base_model(...))`` with
                          nothing in between (perplexity computes them in chunks)
a tiny model              ``tiny_config(...)`` (``hf_posenc.recipes.tiny``, ``hf-posenc check``,
                          the tests), ``test_config_overrides`` (what the test suite adds)
========================  ============================================================

The softmax scale the engine uses is the attention module's own ``scaling`` attribute
(transformers sets it from ``head_dim`` or e.g. Gemma's ``query_pre_attn_scalar``), and a
native sliding window arrives in each layer's attention mask; ``LayerGeometry`` records both
so encodings can read them. An embedding scale (Gemma's sqrt(hidden)) is applied inside the
family's embedding module, before an encoding's ``embed`` stage adds to its output;
``ModelGeometry.embedding_scale`` records it.

How the next families map onto this interface: Gemma 3 sets ``embedding_scale``, one
``LayerGeometry`` per layer (local/global ``rope_theta``, ``sliding_window``,
``softmax_scale`` from ``query_pre_attn_scalar``) and ``qk_norm = "head"`` (a ``LlamaAdapter``
subclass); Phi-3 overrides ``project`` for its fused ``qkv_proj`` (``partial_rotary_factor``
is already in the geometry; ``longrope`` is refused by the rope encoding by name); SmolLM3
marks its NoPE layers ``native_rotary=False``. Today the encodings read the model-wide
``rope_theta``; per-layer thetas need the rotary encodings to read ``geometry.layer(i)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import UnsupportedModelError

Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """Native settings of one decoder layer (hybrid families differ from layer to layer)."""

    #: the base of this layer's native RoPE frequencies (Gemma 3: local and global layers differ)
    rope_theta: float
    #: whether the native model rotates q/k in this layer (False: SmolLM3's NoPE layers)
    native_rotary: bool = True
    #: the native sliding window of this layer (None: full causal attention)
    sliding_window: int | None = None
    #: the native softmax scale of q.k (default head_dim**-0.5), None: not known from the config
    softmax_scale: float | None = None
    #: this layer's native RoPE scaling in hf_posenc's form (Gemma 3: global layers only), None: unscaled
    rope_scaling: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """Shapes and native positional settings of one model, read from its config."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    #: the checkpoint's own RoPE scaling in hf_posenc's form ({"type": ..., ...}), None: unscaled
    rope_scaling: dict[str, Any] | None = None
    #: whether the model has a learned absolute position table of its own (GPT-2's ``wpe``)
    learned_position_table: bool = False
    #: whether the family's own positional encoding is RoPE, on the layers whose
    #: ``LayerGeometry.native_rotary`` is True (a SmolLM3 with every layer NoPE: on none);
    #: False: positions enter some other way (GPT-2's table) and ``rope`` rotates every layer
    rotary_positions: bool = True
    #: factor the family's embedding module multiplies token embeddings by (Gemma: sqrt(hidden))
    embedding_scale: float = 1.0
    #: one entry per layer; empty: every layer has the model-wide settings above
    layers: tuple[LayerGeometry, ...] = ()

    def layer(self, index: int) -> LayerGeometry:
        """The settings of layer ``index`` (the model-wide ones when no per-layer list is given)."""
        if self.layers:
            return self.layers[index]
        return LayerGeometry(
            rope_theta=self.rope_theta, softmax_scale=self.head_dim**-0.5, rope_scaling=self.rope_scaling
        )


class FamilyAdapter:
    """Base class of a model-family adapter; see the module docstring for what each member is.

    Subclasses set the class attributes and fill in every method that raises
    ``NotImplementedError``; they are registered with ``@register_family`` in their own
    module ``hf_posenc/models/<family>.py``.
    """

    #: the family's name: the name of its module in ``hf_posenc/models/``
    family: ClassVar[str] = ""
    #: the ``config.model_type`` values this adapter serves
    model_types: ClassVar[tuple[str, ...]] = ()
    #: peft ``target_modules`` by default (``hf-posenc train --lora``)
    lora_targets: ClassVar[tuple[str, ...]] = ()
    #: whether the targeted layers store weights transposed (GPT-2's ``Conv1D``)
    lora_fan_in_fan_out: ClassVar[bool] = False
    #: logits are ``get_output_embeddings()(base_model(...).last_hidden_state)``, nothing else
    plain_lm_head: ClassVar[bool] = True
    #: config overrides the test suite adds to ``tiny_config`` (e.g. a short sliding window)
    test_config_overrides: ClassVar[dict[str, Any]] = {}

    def check_supported(self, model: nn.Module) -> None:
        """Raise :class:`UnsupportedModelError` (via :meth:`refuse`) for anything in ``model``'s
        config or module structure that this adapter does not reproduce. Matching
        ``model_type`` is not enough: check the modules the other methods rely on."""
        raise NotImplementedError

    def refuse(self, feature: str, value: Any, hint: str = "") -> None:
        """Raise the one-line error naming an unsupported ``feature`` and its ``value``."""
        raise UnsupportedModelError(
            f"{self.family} model with {feature}={value!r} is not supported: hf_posenc's {self.family} "
            f"adapter does not reproduce it{'; ' + hint if hint else ''}"
        )

    def refuse_config_values(self, config: Any, neutral: dict[str, tuple[Any, ...]]) -> None:
        """:meth:`refuse` the first config attribute whose value is not one of its neutral
        values (``{"final_logit_softcapping": (None,)}``); absent attributes are neutral."""
        for name, allowed in neutral.items():
            value = getattr(config, name, None)
            if value is not None and value not in allowed:
                self.refuse(name, value)

    def require_attention_class(self, module: nn.Module, known: tuple[str, ...]) -> None:
        """:meth:`refuse` an attention module whose ``forward`` is not defined by one of the
        ``known`` classes: the patch replaces that forward, so anything a subclass or remote
        code adds there (norms, caps, extra projections) would be dropped silently."""
        owner = next(c for c in type(module).__mro__ if "forward" in c.__dict__)
        if owner.__name__ not in known:
            self.refuse("attention class", owner.__name__, f"known: {', '.join(known)}")

    def require_modules(self, owner: nn.Module, names: tuple[str, ...], where: str) -> None:
        """:meth:`refuse` when ``owner`` lacks one of the submodules the adapter reads."""
        for name in names:
            if not isinstance(getattr(owner, name, None), nn.Module):
                self.refuse(f"{where} without {name}", type(owner).__name__)

    def geometry(self, config: Any) -> ModelGeometry:
        raise NotImplementedError

    def base_model(self, model: nn.Module) -> Any:
        """The decoder stack whose forward sees positions: ``model.model`` / ``model.transformer``
        under any head class (transformers' ``base_model`` follows ``base_model_prefix``), or the
        model itself when it is the headless stack (``LlamaModel``, ``GPT2Model``)."""
        return model.base_model

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Self-attention modules in layer order."""
        raise NotImplementedError

    def neutralize_native_positions(self, model: nn.Module) -> list[Undo]:
        """Switch off the family's own positional encoding; return the undo actions."""
        raise NotImplementedError

    def project(
        self, module: nn.Module, x_qk: torch.Tensor, x_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B,Hq,T,D), k (B,Hkv,T,D), v (B,Hkv,T,D) from the inputs (B,T,hidden), with the
        family's biases and q/k norms applied as its native forward applies them before RoPE."""
        raise NotImplementedError

    def output(self, module: nn.Module, attn: torch.Tensor) -> torch.Tensor:
        """Output projection of the merged heads (B,T,Hq*D) -> (B,T,hidden)."""
        raise NotImplementedError

    def dropout_p(self, module: nn.Module) -> float:
        raise NotImplementedError

    def native_position_table(self, model: nn.Module) -> torch.Tensor:
        """The model's own learned position table (n_positions, hidden), for families that have one."""
        raise NotImplementedError(f"{self.family} models have no learned position table")

    def export_positions(
        self,
        model: nn.Module,
        layers: list[tuple[str, str, dict[str, Any]]],
        tensors: dict[str, torch.Tensor],
    ) -> str | None:
        """Make the *unpatched* ``model`` (its config, and its position table where it has one)
        compute what ``layers`` — one ``(native kind, encoding, resolved params)`` per layer (the kind:
        ``EncodingConfig.native_positions``), ``tensors`` the
        encoding's state dict — computed while patched; return None when done, or why this
        family's native configuration cannot express them (one clause, no trailing period).
        :func:`hf_posenc.export_native` verifies the result by reloading it with plain transformers and comparing logits.

        Here: RoPE on every layer, written as transformers' ``rope_parameters`` (see
        :func:`export_rope_parameters`); families with other native positions override it."""
        if {kind for kind, _, _ in layers} != {"rotary"}:
            return f"its native configuration has RoPE on every layer, not {describe_layers(layers)}"
        config: Any = model.config
        return export_rope_parameters(config, [params for _, _, params in layers], self.geometry(config))

    def native_position_limit(self, config: Any) -> tuple[int, str] | None:
        """``(tokens, description with a {} for the number)`` when the *unpatched* model cannot
        take longer inputs (a learned table), else None."""
        return None

    def tiny_config(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        max_positions: int,
        **special_tokens: int,
    ) -> Any:
        """A small config of this family (random weights are built from it, nothing downloaded)."""
        raise NotImplementedError


class RestoreAttribute:
    """Undo action: put back (or delete) one instance attribute.

    A plain object rather than a closure, so ``copy.deepcopy`` and pickling of the model
    carry it along pointing at the copy's own module (a closure would keep the original)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        self.had = name in owner.__dict__
        self.previous = owner.__dict__.get(name)

    def __call__(self) -> None:
        if self.had:
            setattr(self.owner, self.name, self.previous)
        else:
            self.owner.__dict__.pop(self.name, None)


def describe_layers(layers: list[tuple[str, str, dict[str, Any]]]) -> str:
    """The encoding, or ``A on layers 0, 1, B on layer 2`` for a per-layer list."""
    names = [name for _, name, _ in layers]
    if len(set(names)) == 1:
        return names[0]
    parts = []
    for name in dict.fromkeys(names):
        indices = [str(i) for i, n in enumerate(names) if n == name]
        parts.append(f"{name} on layer{'s' if len(indices) > 1 else ''} {', '.join(indices)}")
    return ", ".join(parts)


#: hf_posenc scaling types whose frequencies change with the sequence length: hf_posenc makes them
#: causal (each query its own length), transformers recomputes them from the whole input
_CAUSAL_ONLY = ("dynamic", "longrope")


def export_rope_parameters(config: Any, params: list[dict[str, Any]], geometry: ModelGeometry) -> str | None:
    """Write the RoPE of ``params`` (one resolved ``rope`` parameter dict per rotating layer, all
    equal) into ``config.rope_parameters`` (transformers 5's form); None when done, else why not.

    ``theta=None`` / ``scaling="model"`` (the checkpoint's own per-layer settings) keep the config as
    it is. ``ntk`` (a static base change) becomes ``default`` with the changed ``rope_theta``."""
    if any(p != params[0] for p in params):
        return "its layers would need different RoPE settings"
    if not params:
        return None
    theta, scaling = params[0].get("theta"), params[0].get("scaling")
    partial = params[0].get("partial_rotary_factor")
    if partial is not None and abs(float(partial) - geometry.partial_rotary_factor) > 1e-12:
        return (
            f"partial_rotary_factor={partial} differs from the checkpoint's {geometry.partial_rotary_factor}"
        )
    current = dict(getattr(config, "rope_parameters", None) or {})
    nested = bool(current) and all(isinstance(v, dict) for v in current.values())
    own_theta = theta is None or float(theta) == float(geometry.rope_theta)
    own_scaling = scaling == "model" or _same_scaling(scaling, geometry.rope_scaling)
    if own_theta and own_scaling:
        return None  # the checkpoint's own settings (per layer where it has them): nothing to change
    if nested:
        return (
            "its RoPE settings are per layer type (nested rope_parameters); only the checkpoint's own export"
        )
    if scaling == "model":
        scaling = geometry.rope_scaling
    theta = float(geometry.rope_theta if theta is None else theta)
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if "partial_rotary_factor" in current:
        out["partial_rotary_factor"] = current["partial_rotary_factor"]
    if scaling is not None:
        kind = scaling["type"]
        if kind in _CAUSAL_ONLY:
            return (
                f"hf_posenc's {kind} scaling is causal (each query uses its own length) while transformers "
                "recomputes it from the whole input, so no native setting gives the same logits"
            )
        if kind == "ntk":  # NTK-aware: the base theta * factor^(d/(d-2)) with d the rotary dimension
            dim = int(geometry.head_dim * geometry.partial_rotary_factor)
            out["rope_theta"] = theta * float(scaling["factor"]) ** (dim / (dim - 2))
        else:
            out["rope_type"] = kind
            out.update({k: v for k, v in scaling.items() if k != "type" and v is not None})
    config.rope_parameters = out
    return None


def _same_scaling(resolved: dict[str, Any] | None, native: dict[str, Any] | None) -> bool:
    """Whether a resolved scaling equals the checkpoint's own (its defaults filled in or not)."""
    if resolved is None or native is None:
        return resolved is None and native is None
    return all(resolved.get(key) == value for key, value in native.items())


#: keys of transformers' ``rope_parameters`` that are not part of the scaling itself
_ROPE_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def native_rope_scaling(config: Any) -> dict[str, Any] | None:
    """The checkpoint's own RoPE scaling (transformers 5 ``config.rope_parameters``) as a
    ``{"type": ..., ...}`` dict, or None when unscaled. Every key is passed on (the rope
    encoding validates them, so a type or key it does not implement, e.g. ``longrope``, is
    refused by name rather than dropped); the original length follows transformers: dynamic
    NTK grows from ``max_position_embeddings``, yarn and llama3 default to it."""
    params = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) if not params else None
    params = dict(params or legacy or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    out: dict[str, Any] = {"type": kind}
    out.update({k: v for k, v in params.items() if k not in _ROPE_BASE_KEYS and v is not None})
    if kind == "linear":  # transformers' linear scaling ignores it (configs may carry one anyway)
        out.pop("original_max_position_embeddings", None)
    elif kind == "dynamic":
        out["original_max_position_embeddings"] = config.max_position_embeddings
    elif kind in ("yarn", "llama3"):
        out.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return out


def replace_forward(module: nn.Module, new_forward: Callable[..., Any]) -> Undo:
    """Route ``module``'s calls to ``new_forward`` for this instance only; return the undo.

    When accelerate has wrapped the module (``_old_forward`` set by a device-map hook), the
    wrapped inner forward is replaced so the hook keeps moving tensors between devices.
    ``new_forward`` should be a picklable callable object (not a closure) so that copies of
    the model get their own.
    """
    attr = "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"
    undo = RestoreAttribute(module, attr)
    setattr(module, attr, new_forward)
    return undo


class RestoreRequiresGrad:
    """Undo action: give parameters back their ``requires_grad`` flags."""

    def __init__(self, module: nn.Module) -> None:
        self.flags = [(p, p.requires_grad) for p in module.parameters()]

    def __call__(self) -> None:
        for p, flag in self.flags:
            p.requires_grad_(flag)


def freeze_parameters(module: nn.Module) -> Undo:
    """Stop gradients (and so weight decay) reaching parameters that the patch bypasses."""
    undo = RestoreRequiresGrad(module)
    for p, _ in undo.flags:
        p.requires_grad_(False)
    return undo
