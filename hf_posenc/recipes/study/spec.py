"""What a study is asked to do: its settings (:class:`StudyConfig`, from flags or a YAML/JSON
file) and the encoding specs it names (``alibi``, ``expe{"scaling": ...}``), their labels and
run-folder names. Imports nothing else of the study, so the study's other modules build on it
without a circle."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ...errors import InvalidParameterError
from ..data import BUILTIN_STDLIB
from ..settings_checks import check_positive_integers

DEFAULT_ENCODINGS = ("rope", "alibi", "t5", "nope", "sinusoidal", "expe", "exqpe")


@dataclasses.dataclass
class StudyConfig:
    output_dir: str = "posenc-study"
    base_model: str | None = None  # None: pretrain the embedded tiny Llama with RoPE
    encodings: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ENCODINGS))
    data: list[str] = dataclasses.field(default_factory=lambda: [BUILTIN_STDLIB])
    eval_data: list[str] | None = None  # default: the validation split of ``data``
    train_split: str = "train"
    eval_split: str = "validation"
    text_field: str = "text"
    max_documents: int | None = None  # cap on training documents (default: all)
    train_length: int = 128
    multiples: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8, 16])
    steps: int = 300  # continued pretraining per encoding
    pretrain_steps: int = 1000  # embedded default only
    batch_size: int = 16
    lr: float = 1e-3
    eval_tokens: int = 32768
    vocab_size: int = 2048  # embedded default only
    hidden_size: int = 128  # embedded default only
    num_layers: int = 4  # embedded default only
    seed: int = 0
    #: train with documents packed per block, positions restarting per document (train --packing)
    packing: bool = False
    #: rows evaluated without training (``TRAINED@{JSON}`` or ``TRAINED@interpolate``; see study_eval);
    #: None: expe/exqpe at factor 2 and rope@interpolate for those of them the study trains
    eval_only: list[str] | None = None
    threads: int | None = None  # torch threads; None: hf_posenc.recipes.threads decides
    #: passkey documents mixed into every pretraining (0: none, no retrieval table); see
    #: hf_posenc.recipes.study.retrieval. The three defaults below are the setting tuned for the
    #: embedded default (README, "Tuning the retrieval experiment"): about half the training blocks
    #: passkey documents, keys 1-99, no instruction line -- the model learns the passkey at the
    #: training length and the encodings differ past it
    retrieval_documents: int = 25000
    retrieval_samples: int = 4  # passkey prompts per evaluation length and depth
    retrieval_max_key: int = 99  # pass keys uniform in [1, this] (Landmark's protocol: 50000)
    retrieval_instruction: bool = False  # the passkey prompt's instruction line (Landmark's protocol: yes)
    report_to: list[str] = dataclasses.field(default_factory=list)  # accelerate trackers of every run

    def __post_init__(self) -> None:
        positive = (
            "train_length",
            "steps",
            "pretrain_steps",
            "batch_size",
            "eval_tokens",
            "hidden_size",
            "num_layers",
            "retrieval_samples",
            "retrieval_max_key",
            "max_documents",  # (None: every document)
        )
        check_positive_integers("study", self, positive, optional=("max_documents",))
        from ..threads import check_threads

        check_threads(self.threads, flag="study: threads")
        if (
            isinstance(self.retrieval_documents, bool)
            or not isinstance(self.retrieval_documents, int)
            or (self.retrieval_documents < 0)
        ):
            raise InvalidParameterError(
                f"study: retrieval_documents={self.retrieval_documents!r} is not allowed; allowed: an integer >= 0"
            )
        if not self.multiples or any(not isinstance(m, int) or m < 1 for m in self.multiples):
            raise InvalidParameterError(
                f"study: multiples={self.multiples!r} is not allowed; allowed: integers >= 1, e.g. 1 2 4 8 16"
            )
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise InvalidParameterError(f"study: lr={self.lr!r} is not allowed; allowed: a finite number > 0")
        if not self.encodings:
            raise InvalidParameterError(
                "study: no encodings given; allowed: one or more names from `hf-posenc list`"
            )
        for spec in self.encodings:
            parse_encoding_spec(spec)  # raises for unknown names or bad JSON
        if self.eval_only is not None and (
            isinstance(self.eval_only, str) or not isinstance(self.eval_only, (list, tuple))
        ):
            raise InvalidParameterError(
                f"study: eval_only={self.eval_only!r} is not allowed; allowed: a list of TRAINED@OVERRIDES rows"
            )


#: row suffixes that train the row with position sampling up to the longest evaluated length
SAMPLING_SUFFIXES = {"~pose": "pose", "~randomized": "randomized"}


def row_sampling(spec: str) -> tuple[str, str]:
    """``"rope~pose"`` -> (``"rope"``, ``"pose"``): a row trained with PoSE (Zhu et al. 2024) or
    randomized positions (Ruoss et al. 2023) to ``train_length * max(multiples)``; else ``"none"``."""
    for suffix, kind in SAMPLING_SUFFIXES.items():
        if spec.endswith(suffix):
            return spec[: -len(suffix)], kind
    return spec, "none"


def parse_encoding_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"alibi"`` or ``'expe{"scaling": {"type": "linear", "factor": 2}}'`` -> (name, params)
    (a ``~pose`` / ``~randomized`` row suffix is not part of the encoding: :func:`row_sampling`)."""
    spec, _ = row_sampling(spec)
    name, brace, rest = spec.partition("{")
    params: dict[str, Any] = {}
    if brace:
        try:
            params = json.loads(brace + rest)
        except json.JSONDecodeError as error:
            raise InvalidParameterError(
                f"study: encoding {spec!r} has parameters that are not JSON: {error}"
            ) from error
        if not isinstance(params, dict):
            raise InvalidParameterError(
                f"study: encoding {spec!r}: parameters must be a JSON object, e.g. 't5{{\"num_buckets\": 16}}'"
            )
    from ...core.request import canonical_request

    return canonical_request(name.strip()), params


def load_study_config(path: str) -> dict[str, Any]:
    """The fields of a study config file (YAML or JSON, e.g. a previous run's study_config.json)."""
    from ..settings_file import list_fields, load_settings_file

    return load_settings_file(
        path,
        allowed=[f.name for f in dataclasses.fields(StudyConfig)],
        section="study",
        lists=list_fields(StudyConfig),
    )


def display_label(spec: str) -> str:
    """A readable label for an encoding spec: ``expe{"scaling": {"type": "linear", "factor": 2}}`` ->
    ``expe (scaling linear x2)``."""
    name, params = parse_encoding_spec(spec)
    parts = []
    for key, value in params.items():
        if isinstance(value, dict) and "type" in value:
            factor = f" x{value['factor']:g}" if isinstance(value.get("factor"), (int, float)) else ""
            rest = ", ".join(f"{k}={v}" for k, v in value.items() if k not in ("type", "factor"))
            parts.append(f"{key} {value['type']}{factor}" + (f" ({rest})" if rest else ""))
        elif isinstance(value, dict):
            parts.extend(f"{key}.{k}={v}" for k, v in value.items())
        else:
            parts.append(f"{key}={value}")
    sampling = {"none": "", "pose": " + PoSE", "randomized": " + randomized positions"}[row_sampling(spec)[1]]
    return (f"{name} ({', '.join(parts)})" if parts else name) + sampling


def spec_slug(spec: str) -> str:
    """A directory name for an encoding spec: ``expe{"l": 8}`` -> ``expe_l_8``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", spec).strip("_")
