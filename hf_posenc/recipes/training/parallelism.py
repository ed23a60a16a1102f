"""Which sequence-parallel engine can serve a run, decided before any model loads.

Two engines split one long sequence over several GPUs, both through accelerate's
:class:`accelerate.ParallelismConfig` (we write no ring attention of our own):

* **context parallelism** (``cp_size``, accelerate over FSDP2, torch's ring attention): every rank
  holds ``seq_len / cp_size`` tokens (round-robin load balanced in ``2 * cp_size`` chunks, so
  ``seq_len`` must divide by ``2 * cp_size``) and torch swaps ``F.scaled_dot_product_attention``
  for ring attention. It is exact only for attention that *is* plain causal SDPA: no bias, no
  explicit score matrix, no state carried along the sequence. accelerate's hook drops the
  attention mask and forces ``is_causal=True``; hf_posenc's core then calls SDPA with
  ``is_causal=True`` (``hf_posenc.attention.core``), which torch replaces.
* **DeepSpeed Ulysses** (``sp_size``, ``sp_backend="deepspeed"``): every rank attends a slice of
  the heads over the whole sequence. DeepSpeed installs it as a transformers attention function
  (``ALL_ATTENTION_FUNCTIONS``) that a native model's attention calls after its projections; a
  patched model's attention never calls that registry, so hf_posenc does the same exchange in its
  own attention (:mod:`hf_posenc.attention.head_parallel`, ``enable_head_parallel`` over DeepSpeed's
  sequence-parallel group), with every per-head encoding quantity taken at the rank's head offset.
  It serves the encodings :func:`~hf_posenc.attention.head_parallel.head_parallel_refusal` accepts
  (SDPA and score-bias forms). The loop's side (every rank of a group on the same batch, each on
  its tokens, the loss over the whole batch's targets) is :mod:`.ulysses`.

The attention an encoding needs is asked from the encoding itself (its active stages and class
flags, :class:`~hf_posenc.encodings.base.Encoding`), never from its name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ...errors import InvalidParameterError

#: attention forms, from the encoding's interface
SDPA = "plain causal SDPA"  # rotate / embed / layer_input / adjust_output only
SCORE_BIAS = "score bias"  # an additive bias on the logits
EXPLICIT = "explicit scores"  # logits / transform_scores / normalize: the (Tq, Tk) matrix itself
CONTEXTUAL = "state along the sequence"  # stateful, token mixing before attention, a stream

#: which forms each engine serves exactly
ENGINE_FORMS: dict[str, frozenset[str]] = {
    "context_parallel": frozenset({SDPA}),
}


def attention_form(encoding: Any) -> str:
    """The attention an encoding instance needs, from its flags and active stages."""
    stages = set(encoding.active_stages())
    if (
        getattr(encoding, "stateful", False)
        or getattr(encoding, "attends_stream", False)
        or getattr(encoding, "carries_layer_stream", False)
        or "adjust_qkv" in stages  # may mix neighbouring tokens (token shift): crosses shard edges
    ):
        return CONTEXTUAL
    if stages & {"logits", "transform_scores", "normalize"}:
        return EXPLICIT
    if "score_bias" in stages:
        return SCORE_BIAS
    return SDPA


#: a small geometry to build an encoding on before the model loads (forms do not depend on sizes)
def _probe_geometry(num_layers: int) -> Any:
    from ...models.base import ModelGeometry

    return ModelGeometry(
        family="probe",
        hidden_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
    )


def probe_encodings(encoding: Any, params: Mapping[str, Any] | None = None) -> list[Any]:
    """One instance of each encoding of a request (a name, or a per-layer pattern such as
    ``rope*3+nope``), built on a small CPU geometry; loads no model.

    Caveat: a checkpoint's own RoPE scaling (e.g. a native dynamic NTK config) is not seen here;
    :func:`model_forms` re-asks the patched model's own encodings once it is loaded."""
    from ...core.request import is_pattern_text, parse_pattern_text, plan_request

    num_layers = len(parse_pattern_text(encoding)) if is_pattern_text(encoding) else 1
    geometry = _probe_geometry(num_layers)
    plan = plan_request(encoding, num_layers, params or None)
    with torch.device("cpu"):
        return [cls(config.resolve(geometry), geometry) for cls, config in plan.parts]


def request_forms(encoding: Any, params: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Per encoding of a request: its attention form (:func:`probe_encodings`; loads no model)."""
    return {instance.name: attention_form(instance) for instance in probe_encodings(encoding, params)}


def model_forms(model: Any) -> dict[str, str]:
    """Per encoding of a patched model: its attention form ({} for a native model)."""
    return {m.name: attention_form(m) for m in model_encodings(model)}


def engine_refusal(engine: str, forms: Mapping[str, str]) -> str | None:
    """Why context parallelism cannot serve encodings of these forms (one line), or None when it can.
    (Ulysses is asked of the encodings themselves: :func:`sequence_parallel_refusal`.)"""
    allowed = ENGINE_FORMS[engine]
    bad = {name: form for name, form in forms.items() if form not in allowed}
    if not bad:
        return None
    name, form = next(iter(sorted(bad.items())))
    return (
        f"--context-parallel cannot serve encoding {name!r}: it attends with {form}, which torch's ring "
        "attention cannot split exactly; allowed: encodings attending with plain causal SDPA "
        "(rotary, absolute-embedding, ExPE-style and position-free encodings, and hybrids of them)"
    )


def sequence_parallel_refusal(encodings: Iterable[Any]) -> str | None:
    """Why Ulysses (head-parallel attention) cannot serve these encoding instances (one line), or None."""
    from ...attention.head_parallel import head_parallel_refusal

    for encoding in sorted(encodings, key=lambda e: e.name):
        reason = head_parallel_refusal(encoding)
        if reason:
            return (
                f"--sequence-parallel (DeepSpeed Ulysses) cannot serve encoding {encoding.name!r}: {reason}; "
                "allowed: encodings attending with SDPA, with or without a score bias (and hybrids of them), "
                "or --context-parallel for plain causal SDPA encodings"
            )
    return None


def model_encodings(model: Any) -> list[Any]:
    """The encoding instances of a patched model ([] for a native model)."""
    from ...encodings.base import Encoding

    posenc = getattr(model, "posenc", None)
    return [] if posenc is None else [m for m in posenc.modules() if isinstance(m, Encoding)]


def _launched_with_fsdp2() -> bool:
    return (
        os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
        and os.environ.get("FSDP_VERSION", "1") == "2"
    )


def launch_degrees(context_parallel: int, sequence_parallel: int) -> tuple[int, int]:
    """The degrees of the run: the flags, or the launch config's ``parallelism_config`` (accelerate
    exports it as ``PARALLELISM_CONFIG_CP_SIZE`` / ``_SP_SIZE``) where a flag is left at 1; a flag
    that contradicts the launch config is refused."""
    degrees = []
    for flag, value, variable in (
        ("--context-parallel", context_parallel, "PARALLELISM_CONFIG_CP_SIZE"),
        ("--sequence-parallel", sequence_parallel, "PARALLELISM_CONFIG_SP_SIZE"),
    ):
        launched = os.environ.get(variable, "1")
        try:
            from_launch = int(launched)
        except ValueError:
            from_launch = 1
        if value > 1 and from_launch > 1 and value != from_launch:
            raise InvalidParameterError(
                f"{flag} {value} is not allowed: the accelerate launch config sets {variable}={launched}; "
                f"allowed: {flag} {from_launch}, or leave the flag out"
            )
        degrees.append(value if value > 1 else from_launch)
    return degrees[0], degrees[1]


def check_parallelism(
    context_parallel: int,
    sequence_parallel: int,
    *,
    seq_len: int,
    encoding: Any,
    params: Mapping[str, Any] | None,
    model_config: Mapping[str, Any] | None = None,
    loss: str = "full",
    packing: bool = False,
    position_sampling: str = "none",
) -> None:
    """Refuse, in one line naming the value, a setting neither engine can run. Loads no model.

    ``model_config``: the checkpoint's config.json (heads for Ulysses), when known."""
    for flag, value in (("--context-parallel", context_parallel), ("--sequence-parallel", sequence_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameterError(f"{flag} {value!r} is not allowed; allowed: an integer >= 1")
    context_parallel, sequence_parallel = launch_degrees(context_parallel, sequence_parallel)
    if context_parallel > 1 and sequence_parallel > 1:
        raise InvalidParameterError(
            f"--context-parallel {context_parallel} with --sequence-parallel {sequence_parallel} is not "
            "allowed; allowed: one of them (accelerate runs one sequence engine at a time)"
        )
    if context_parallel == 1 and sequence_parallel == 1:
        return
    engine = "context_parallel" if context_parallel > 1 else "sequence_parallel"
    degree = max(context_parallel, sequence_parallel)
    if engine == "context_parallel":
        refusal = engine_refusal(engine, request_forms(encoding, params) if encoding else {})
    else:
        refusal = sequence_parallel_refusal(probe_encodings(encoding, params) if encoding else [])
    if refusal:
        raise InvalidParameterError(refusal)
    if engine == "context_parallel" and packing:
        raise InvalidParameterError(
            f"--packing with --context-parallel {degree} is not allowed: torch's ring attention drops the "
            "document mask and would attend across documents; allowed: --packing without --context-parallel"
        )
    if engine == "context_parallel" and position_sampling != "none":
        raise InvalidParameterError(
            f"--position-sampling {position_sampling} with --context-parallel {degree} is not allowed: context "
            "parallelism drops attention masks; allowed: --position-sampling none"
        )
    if engine == "context_parallel" and loss != "full":
        raise InvalidParameterError(
            f"--loss {loss} with --context-parallel {degree} is not allowed: it shifts labels inside each "
            "rank's shard; allowed: --loss full (labels are shifted before sharding)"
        )
    if engine == "context_parallel" and seq_len % (2 * degree):
        raise InvalidParameterError(
            f"--seq-len {seq_len} is not allowed with --context-parallel {degree}; allowed: a multiple of "
            f"{2 * degree} (2 x the degree: torch's load balancer cuts the sequence into 2 x {degree} chunks)"
        )
    if engine == "sequence_parallel":
        if seq_len % degree:
            raise InvalidParameterError(
                f"--seq-len {seq_len} is not allowed with --sequence-parallel {degree}; allowed: a multiple of "
                f"{degree}"
            )
        heads = dict(model_config or {})
        for key in ("num_attention_heads", "num_key_value_heads"):
            count = heads.get(key)
            if isinstance(count, int) and count % degree:
                raise InvalidParameterError(
                    f"--sequence-parallel {degree} is not allowed: the model has {key}={count}; allowed: a "
                    f"degree dividing {count} (Ulysses gives each rank whole heads)"
                )
        _check_ulysses_run(degree, packing=packing, position_sampling=position_sampling)
        return
    if not torch.cuda.is_available():
        raise InvalidParameterError(
            f"--context-parallel {degree} needs CUDA GPUs and none is visible; allowed: 1 on this machine "
            "(DDP/FSDP over processes, and --sequence-parallel, work on CPU)"
        )
    if not _launched_with_fsdp2():
        raise InvalidParameterError(
            f"--context-parallel {degree} needs an FSDP2 launch; allowed: accelerate launch --config_file "
            "recipes/accelerate/cp_fsdp2.yaml"
        )


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _check_ulysses_run(degree: int, *, packing: bool, position_sampling: str) -> None:
    """What ``hf-posenc train`` cannot run under DeepSpeed Ulysses, and what the launch lacks."""
    flag = f"--sequence-parallel {degree}"
    if packing:
        raise InvalidParameterError(
            f"--packing with {flag} is not allowed: head-parallel attention needs positions running through "
            "the whole sequence (packed documents restart them); allowed: --packing without --sequence-parallel"
        )
    if position_sampling != "none":
        raise InvalidParameterError(
            f"--position-sampling {position_sampling} with {flag} is not allowed: head-parallel attention needs "
            "positions 0, 1, 2, ... through the sequence; allowed: --position-sampling none"
        )
    if not _deepspeed_installed():
        raise InvalidParameterError(
            f"{flag} needs DeepSpeed, which is not installed; allowed: pip install deepspeed (on CPU: "
            "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed), or --context-parallel"
        )
    from .ulysses import deepspeed_launched

    if not deepspeed_launched():
        raise InvalidParameterError(
            f"{flag} needs a DeepSpeed launch; allowed: accelerate launch --config_file "
            "recipes/accelerate/ulysses.yaml --num_processes M -m hf_posenc train ... (M a multiple of "
            f"{degree})"
        )
    processes = os.environ.get("WORLD_SIZE", "1")
    if not processes.isdigit() or int(processes) < degree or int(processes) % degree:
        raise InvalidParameterError(
            f"{flag} is not allowed with {processes} launched processes; allowed: a number of processes that "
            f"is a multiple of {degree} (each group of {degree} splits one sequence)"
        )


def parallelism_config(
    context_parallel: int, sequence_parallel: int, num_processes: int, seq_len: int | None = None
) -> Any:
    """accelerate's ParallelismConfig for the run, or None when neither engine is asked for.

    The processes left over after the sequence engine shard the weights (FSDP2) for context
    parallelism and replicate them for Ulysses (``dp_replicate_size``: the groups; DeepSpeed keeps its
    own data-parallel groups, accelerate sizes DeepSpeed's batch from it)."""
    if context_parallel == 1 and sequence_parallel == 1:
        return None
    from accelerate import ParallelismConfig

    if context_parallel > 1:
        if num_processes % context_parallel:
            raise InvalidParameterError(
                f"--context-parallel {context_parallel} is not allowed with {num_processes} processes; "
                f"allowed: a degree dividing the number of processes"
            )
        return ParallelismConfig(cp_size=context_parallel, dp_shard_size=num_processes // context_parallel)
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    # the attention implementation is set once the model is loaded (ulysses.configure_deepspeed)
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length=seq_len, sp_seq_length_is_variable=seq_len is None, sp_attn_implementation="sdpa"
    )
    # the groups as data-parallel replicas: accelerate sizes DeepSpeed's train_batch_size from them
    groups = max(1, num_processes // sequence_parallel)
    return ParallelismConfig(
        sp_size=sequence_parallel, sp_backend="deepspeed", sp_handler=handler, dp_replicate_size=groups
    )


@contextlib.contextmanager
def context_parallel_shards(accelerator: Any, inputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """Under context parallelism: shard this micro-batch's tensors along the sequence (accelerate's
    ``maybe_context_parallel``). Position ids are made explicit first (each rank must see its
    tokens' true positions, not ``0..T/cp``) and labels are shifted before sharding (transformers
    shifts inside the loss, which would cross shard edges) and passed as ``shift_labels``.
    Without context parallelism: nothing changes."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not getattr(config, "cp_enabled", False):
        yield
        return
    ids = inputs["input_ids"]  # (B, T)
    if "position_ids" not in inputs:
        inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
    if "labels" in inputs:
        labels = inputs["labels"]  # (B, T)
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        # transformers computes a loss only when ``labels`` is given, and then reads ``shift_labels``
        # instead of shifting it: one sharded tensor under both names
        inputs["labels"] = inputs["shift_labels"] = shifted
    buffers = [inputs[key] for key in ("input_ids", "position_ids", "shift_labels") if key in inputs]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        yield
