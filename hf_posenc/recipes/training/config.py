"""Settings of one continued-pretraining run, validated before any model is loaded."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError
from ..settings_checks import check_positive_integers


@dataclasses.dataclass
class TrainConfig:
    """Everything ``hf-posenc train`` needs; ``to_json``/``from_json`` round-trip it."""

    model: str
    output_dir: str
    data: list[str] = dataclasses.field(default_factory=lambda: ["builtin:stdlib"])
    encoding: str | None = None
    encoding_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str | None = None  # default: the model's own
    text_field: str = "text"
    split: str = "train"
    max_documents: int | None = None
    seq_len: int = 512
    batch_size: int = 8  # sequences per process per micro-step
    grad_accum: int = 1
    max_steps: int = 1000  # optimizer steps
    lr: float = 3e-4
    end_lr_ratio: float = 0.1
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    encoding_lr: float | None = None  # learning rate of the encoding's own parameters (default: lr)
    save_every: int = 0  # 0: only the final model
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    dtype: str = "float32"
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # default: attention and MLP projections of the family
    lora_trainable: list[str] | None = None  # "embed", "norm": trained fully beside LoRA (LongLoRA)
    s2_attn: bool = False  # LongLoRA's shifted sparse attention in training forwards (see s2.py)
    s2_group_size: int | float | None = None  # tokens, or a fraction of seq_len; None: 1/4 (LongLoRA)
    s2_wrap: bool = False  # the paper's rolled groups instead of LongLoRA's unrolled partition
    ddp_timeout: int = 1800  # seconds a collective may wait for the other processes
    report_to: list[str] = dataclasses.field(default_factory=list)  # accelerate trackers
    data_cache: str | None = None  # tokenised data (Arrow); default: OUTPUT_DIR/data-cache
    num_proc: int | None = None  # tokenisation workers
    threads: int | None = None  # torch threads; None: hf_posenc.recipes.threads decides
    loss: str = "full"  # "chunked": no (tokens x vocabulary) logits (see loss.py)
    position_sampling: str = "none"  # "pose" or "randomized" (see sampling.py)
    target_length: int | None = None  # the length sampled positions reach
    packing: bool = False  # positions restart per document, attention stays inside it (see feed.py)
    eval_every: int = 0  # held-out loss every N steps (0: never); see validation.py
    eval_data: list[str] | None = None  # held-out sources; default: the eval_split of data
    eval_split: str = "validation"
    eval_tokens: int = 16384  # held-out tokens each evaluation reads
    context_parallel: int = 1  # accelerate CP degree (FSDP2, ring attention); see parallelism.py
    sequence_parallel: int = 1  # DeepSpeed Ulysses degree through accelerate; see parallelism.py

    def __post_init__(self) -> None:
        positive = (
            "seq_len",
            "batch_size",
            "grad_accum",
            "max_steps",
            "keep_checkpoints",
            "log_every",
            "lora_r",
            "ddp_timeout",
            "max_documents",  # (None: every document; 0 read none, and the error then blamed the data)
        )
        check_positive_integers("train", self, positive, optional=("max_documents",))
        if self.lora and (
            isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, int) or self.lora_alpha < 1
        ):
            raise InvalidParameterError(  # (0 scales the adapters' output to nothing: a run that learns nothing)
                f"train: lora_alpha={self.lora_alpha!r} is not allowed; allowed: an integer >= 1 (LoRA's scale is "
                "alpha / r)"
            )
        if self.eval_every < 0 or self.eval_tokens < 1:
            raise InvalidParameterError(
                f"train: eval_every={self.eval_every!r}, eval_tokens={self.eval_tokens!r}; allowed: "
                "eval_every >= 0 (0: never), eval_tokens >= 1"
            )
        if self.save_every < 0:
            raise InvalidParameterError(
                f"train: save_every={self.save_every!r} is not allowed; allowed: >= 0"
            )
        for name in ("lr", "weight_decay", "max_grad_norm", "lora_dropout", "end_lr_ratio", "warmup_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidParameterError(
                    f"train: {name}={value!r} is not allowed; allowed: a finite number >= 0"
                )
        if not 0 <= self.lora_dropout < 1:
            raise InvalidParameterError(
                f"train: lora_dropout={self.lora_dropout!r} is not allowed; allowed: a probability in [0, 1)"
            )
        if self.lora_targets is not None and not self.lora:
            raise InvalidParameterError(
                f"train: lora_targets={self.lora_targets!r} without lora would be ignored; allowed: add --lora "
                "(LoRA on those modules) or drop --lora-targets"
            )
        if self.lora_targets is not None and (
            not self.lora_targets or not all(isinstance(t, str) and t for t in self.lora_targets)
        ):
            raise InvalidParameterError(
                f"train: lora_targets={self.lora_targets!r} is not allowed; allowed: module names such as q_proj"
            )
        from .s2 import check_lora_trainable, check_s2_settings

        check_lora_trainable(self.lora, self.lora_trainable)
        self.s2_group_size = check_s2_settings(
            self.s2_attn, self.s2_group_size, self.s2_wrap, seq_len=self.seq_len, packing=self.packing
        )
        if self.encoding_lr is not None and not (math.isfinite(self.encoding_lr) and self.encoding_lr >= 0):
            raise InvalidParameterError(
                f"train: encoding_lr={self.encoding_lr!r} is not allowed; allowed: a finite number >= 0"
            )
        from ..threads import check_threads

        check_threads(self.threads, flag="train: threads")
        if self.num_proc is not None and self.num_proc < 1:
            raise InvalidParameterError(f"train: num_proc={self.num_proc!r} is not allowed; allowed: >= 1")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.end_lr_ratio <= 1:
            raise InvalidParameterError(
                f"train: warmup_ratio={self.warmup_ratio!r}, end_lr_ratio={self.end_lr_ratio!r}; allowed: "
                "warmup_ratio in [0, 1), end_lr_ratio in [0, 1]"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidParameterError(f"train: dtype={self.dtype!r}; allowed: float32, bfloat16")
        if self.dtype == "float16":
            raise InvalidParameterError(
                "train: dtype='float16' (pure fp16 weights) is not allowed: AdamW updates below fp16's "
                "resolution are lost and the loss overflows to NaN; allowed: --dtype float32 (with "
                "--mixed-precision fp16 or bf16 on a GPU) or --dtype bfloat16"
            )
        check_position_sampling(self.position_sampling, self.target_length, self.seq_len)
        if self.loss not in ("full", "chunked"):
            raise InvalidParameterError(f"train: loss={self.loss!r} is not allowed; allowed: full, chunked")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise InvalidParameterError(
                f"train: mixed_precision={self.mixed_precision!r}; allowed: no, bf16, fp16"
            )

    @property
    def global_batch_per_process_step(self) -> int:
        return self.batch_size * self.grad_accum

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())


def preflight(config: TrainConfig, *, model: Any = None, tokenizer: Any = None) -> None:
    """Every check of a run that needs no model: paths, tokenizer, data sources, encoding and its
    parameters. Imports no model (``train --dry-run`` runs it and stops)."""
    from ..data import check_sources
    from ..preflight import check_encoding_parts, check_model_path, check_tokenizer_path

    saved = None
    if model is None:
        saved = check_model_path(config.model, need_tokenizer=tokenizer is None and config.tokenizer is None)
    if config.tokenizer is not None and tokenizer is None:
        check_tokenizer_path(config.tokenizer)
    check_sources(config.data)
    if config.eval_every:
        from .validation import check_validation

        check_validation(config)
        if config.eval_data:
            check_sources(config.eval_data)
    if model is None or _patch_info(model) is None:
        _, elements = check_encoding_parts(config.encoding, config.encoding_params, saved)
        if config.encoding_lr is not None and elements == 0:  # before the weights load
            from .model_setup import refuse_encoding_lr

            refuse_encoding_lr(config.encoding_lr)  # (build_optimizer checks a given model too)
    from .parallelism import check_parallelism

    check_parallelism(
        config.context_parallel,
        config.sequence_parallel,
        seq_len=config.seq_len,
        encoding=config.encoding or ((saved or {}).get("posenc") or None),
        params=config.encoding_params,
        model_config=saved,
        loss=config.loss,
        packing=config.packing,
        position_sampling=config.position_sampling,
    )
    if config.s2_attn:
        from .s2 import check_s2_request

        check_s2_request(config, saved)
    if config.lora and (config.lora_targets or config.lora_trainable) and saved is not None:
        from .lora import check_lora_of_config

        check_lora_of_config(config.model, config.lora_targets, config.lora_trainable)


def _patch_info(model: Any) -> Any:
    from ...core.patch import patch_info

    return patch_info(model)


#: ``--position-sampling`` choices (the samplers are in :mod:`.sampling`)
SAMPLINGS = ("none", "pose", "randomized")


def check_position_sampling(kind: str, target: int | None, seq_len: int) -> None:
    """One line for a sampling, target length and window that do not go together."""
    if kind not in SAMPLINGS:
        raise InvalidParameterError(
            f"train: position_sampling={kind!r} is not allowed; allowed: {', '.join(SAMPLINGS)}"
        )
    if kind == "none":
        if target is not None:
            raise InvalidParameterError(
                f"train: target_length={target} does nothing without --position-sampling; allowed: "
                "--position-sampling pose or randomized with it, or no --target-length"
            )
        return
    if target is None or isinstance(target, bool) or not isinstance(target, int) or target < seq_len:
        raise InvalidParameterError(
            f"train: target_length={target!r} with --position-sampling {kind} is not allowed; allowed: an "
            f"integer >= seq_len ({seq_len}), the length the sampled positions should reach"
        )
