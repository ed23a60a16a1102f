"""The lm-eval model ``hf-posenc``: lm-eval's HF model, loading through :func:`hf_posenc.load_model`.

Importing this module imports lm-eval and registers the model; ``hf-posenc lm-eval`` does that
before handing over to lm-eval (which has no plugin discovery). Usage::

    hf-posenc lm-eval --model hf-posenc --model_args pretrained=DIR --tasks hellaswag
    hf-posenc lm-eval --model hf-posenc --model_args pretrained=DIR,encoding=t5,num_buckets=16 ...

A checkpoint saved from a patched model is re-patched from its ``config.posenc``, and encoding
parameters in model_args override its saved inference-time ones for the evaluation
(``pretrained=runs/expe/final,scaling.type=linear,scaling.factor=2``: position interpolation
of a model trained unscaled); a plain one is patched with ``encoding=NAME`` and that
encoding's parameters. Dotted keys build nested
parameters: ``encoding=rope,scaling.type=linear,scaling.factor=4.0``. Every other key is
lm-eval's ``HFLM`` argument (``dtype``, ``batch_size``, ``device``, ``parallelize``, ...) or a
transformers loading argument (``attn_implementation``, ``device_map``, ...).

Only the model creation is replaced (``HFLM._create_model``, the documented extension point),
so lm-eval keeps placing the model on ``device``, casting ``dtype``, ``parallelize=True`` and
data parallelism under ``accelerate launch``. The tokenizer is lm-eval's, loaded from the same
path (or ``tokenizer=``).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype

from ...core.loading import load_model
from ...core.patch import CONFIG_KEY, patch_info
from ...core.plan import check_patch_fits
from ...core.request import check_overrides, check_request, matches_saved, saved_description
from ...errors import InvalidParameterError, UnsupportedModelError

#: keyword arguments of ``from_pretrained`` accepted in model_args (not encoding parameters)
HF_LOAD_KWARGS = frozenset(
    {
        "attn_implementation",
        "device_map",
        "max_memory",
        "low_cpu_mem_usage",
        "cache_dir",
        "local_files_only",
        "token",
        "use_safetensors",
        "variant",
        "load_in_8bit",
        "load_in_4bit",
        "bnb_4bit_compute_dtype",
        "bnb_4bit_quant_type",
        "bnb_4bit_use_double_quant",
    }
)
#: HFLM options that load something other than a plain checkpoint; hf-posenc refuses them
UNSUPPORTED_OPTIONS = ("peft", "delta", "autogptq", "gptqmodel", "gguf_file", "tp_plan")


@dataclasses.dataclass
class ModelArgs:
    """model_args split into the checkpoint, the encoding request and the rest (for HFLM)."""

    pretrained: str
    encoding: str | None
    encoding_params: dict[str, Any]
    other: dict[str, Any]


def _hflm_parameters() -> set[str]:
    return set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}


def split_model_args(args: dict[str, Any]) -> ModelArgs:
    """Split ``model_args`` (a dict as lm-eval parses it); dotted keys become nested dicts."""
    args = dict(args)
    if not args.get("pretrained"):
        raise InvalidParameterError("model_args needs pretrained=DIR (a checkpoint folder or hub id)")
    pretrained = str(args.pop("pretrained"))
    encoding = args.pop("encoding", None)
    known = _hflm_parameters() | HF_LOAD_KWARGS
    params: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in args.items():
        if key in known:
            other[key] = value
            continue
        *parents, leaf = key.split(".")
        target = params
        for parent in parents:
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                raise InvalidParameterError(f"model_args: {key!r} conflicts with {parent}={target!r}")
        target[leaf] = value
    return ModelArgs(pretrained, None if encoding is None else str(encoding), params, other)


def check_checkpoint(pretrained: str) -> None:
    """Raise FileNotFoundError unless ``pretrained`` is a checkpoint folder or a loadable hub id."""
    path = os.path.expanduser(pretrained)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"checkpoint directory {pretrained!r} has no config.json")
        return
    looks_local = pretrained.startswith((".", "/", "~")) or pretrained.count("/") > 1 or os.path.exists(path)
    if looks_local:
        raise FileNotFoundError(f"checkpoint directory {pretrained!r} does not exist")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(pretrained)
    except OSError as error:
        raise FileNotFoundError(
            f"checkpoint {pretrained!r} is neither a local directory nor a reachable hub model id ({error})"
        ) from None


def check_model_args(args: ModelArgs) -> None:
    """Every check :func:`hf_posenc.load_model` would make, without loading weights."""
    from transformers import AutoConfig

    check_checkpoint(args.pretrained)
    if not args.other.get("tokenizer"):
        from ..preflight import check_tokenizer_path

        check_tokenizer_path(os.path.expanduser(args.pretrained), what="pretrained")
    for option in UNSUPPORTED_OPTIONS:
        if args.other.get(option):
            raise UnsupportedModelError(f"model_args {option}= is not supported by the hf-posenc model")
    config = AutoConfig.from_pretrained(os.path.expanduser(args.pretrained))
    saved = getattr(config, CONFIG_KEY, None)
    if saved:
        if args.encoding is not None and not matches_saved(args.encoding, saved):
            raise InvalidParameterError(
                f"{args.pretrained!r} was saved with encoding {saved_description(saved)!r}; cannot evaluate it as "
                f"{args.encoding!r} (give the original checkpoint to switch encodings)"
            )
        # overrides of inference-time parameters (e.g. scaling.type=linear,scaling.factor=2: position
        # interpolation at evaluation); hf_posenc.reconfigure checks them against the learned tensors
        check_overrides(saved, args.encoding_params, where=f"model_args of {args.pretrained!r}")
    elif args.encoding is not None:
        check_request(args.encoding, args.encoding_params)
    if saved or args.encoding is not None:  # a pattern past the depth, a scaling past the dtype, ...
        check_patch_fits(config, None if saved else args.encoding, args.encoding_params)
    elif args.encoding_params:
        allowed = ", ".join(
            sorted((_hflm_parameters() | HF_LOAD_KWARGS) - {"pretrained", *UNSUPPORTED_OPTIONS})
        )
        raise InvalidParameterError(
            f"model_args {sorted(args.encoding_params)} are not model options, and {args.pretrained!r} is not "
            f"patched, so they cannot be encoding parameters (add encoding=NAME); model options: {allowed}"
        )


@register_model("hf-posenc")
class PosencLM(HFLM):
    """lm-eval's ``HFLM`` whose model comes from :func:`hf_posenc.load_model`."""

    def __init__(
        self, pretrained: str, encoding: str | None = None, device: str | None = None, **kwargs: Any
    ) -> None:
        if not isinstance(pretrained, str):
            raise InvalidParameterError(
                "the hf-posenc model takes pretrained=PATH (a string), not a model object"
            )
        args = split_model_args({"pretrained": pretrained, "encoding": encoding, **kwargs})
        check_model_args(args)
        self._posenc_request = (args.encoding, args.encoding_params)
        if device is None:  # HFLM's default is "cuda" even without a GPU
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=os.path.expanduser(args.pretrained), device=device, **args.other)

    def _create_model(
        self,
        pretrained: str,
        revision: str | None = "main",
        dtype: Any = "auto",
        trust_remote_code: bool | None = False,
        parallelize: bool | None = False,
        gpus: int | None = None,
        max_memory_per_gpu: int | str | None = None,
        max_cpu_memory: int | str | None = None,
        offload_folder: str | None = "./offload",
        quantization_config: Any = None,
        subfolder: str = "",
        **kwargs: Any,
    ) -> None:
        """Load (and patch) the model like ``HFLM._create_model`` does, through ``load_model``."""
        for option in UNSUPPORTED_OPTIONS:
            if kwargs.pop(option, None):
                raise UnsupportedModelError(f"model_args {option}= is not supported by the hf-posenc model")
        model_kwargs = dict(kwargs)
        model_kwargs.update(
            self._get_accelerate_args(
                parallelize=parallelize,
                device_map=kwargs.get("device_map"),
                max_memory_per_gpu=max_memory_per_gpu,
                max_cpu_memory=max_cpu_memory,
                offload_folder=offload_folder,
                gpus=gpus,
            )
        )
        if quantization_config is not None:
            model_kwargs["quantization_config"] = quantization_config
        if subfolder:
            model_kwargs["subfolder"] = subfolder
        encoding, params = self._posenc_request
        self._model = load_model(
            pretrained,
            encoding,
            params,
            revision=revision,
            dtype=get_dtype(dtype),
            trust_remote_code=trust_remote_code,
            **model_kwargs,
        )

    def get_model_info(self) -> dict[str, Any]:
        """lm-eval's model info plus the encoding; no hub lookup for a local checkpoint."""
        if os.path.isdir(str(self.pretrained)):
            info = {
                "model_num_parameters": self._model.num_parameters(),
                "model_dtype": self._model.dtype,
                "model_revision": self.revision,
                "model_sha": "",
            }
        else:
            info = super().get_model_info()
        info["posenc"] = patch_info(self._model)
        return info


def quiet_git_probe() -> None:
    """Keep lm-eval's git probe off the console.

    lm-eval records ``git describe --always`` of the working directory in its results and lets
    git's stderr through, so every run outside a git checkout printed ``fatal: not a git
    repository``. lm-eval has no option for this; its evaluator's probe is replaced by the same
    command with git's stderr discarded (same value in the results, None outside a checkout)."""
    import subprocess

    from lm_eval import evaluator

    def git_commit_hash() -> str | None:
        try:
            out = subprocess.run(
                ["git", "describe", "--always"], capture_output=True, text=True, check=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() or None

    evaluator.get_git_commit_hash = git_commit_hash
