"""The study's evaluation: every trained run, plus evaluation-only rows.

An evaluation-only row takes a run the study trained and evaluates it with inference-time
encoding parameters changed (:func:`hf_posenc.reconfigure`), without any further training —
the shape of the ExPE paper's Table 3 (ExPE/ExQPE trained unscaled, evaluated "scaled by
0.5", i.e. positions divided by 2) and of position interpolation at inference for RoPE (Chen
et al. 2023, arXiv:2306.15595). A row is written ``TRAINED@OVERRIDES``:

- ``'expe@{"scaling": {"type": "linear", "factor": 2}}'`` — the overrides (JSON) at every length;
- ``rope@interpolate`` — linear interpolation with factor = evaluation length / training length
  at each length (1 at 1x, 16 at 16x), so every length maps onto the trained positions;
- ``'rope@selfextend{"group_size": 32, "window": 64}'`` — another encoding that extends the
  trained one without training (``EncodingConfig.extends``: selfextend, rerope, leaky_rerope on a
  rope run), with the trained run's shared parameters (RoPE's theta, scaling) and these; a
  ``window`` or ``group_size`` left out is chosen from the study: window = training length / 2,
  and the smallest group size whose grouped distances stay inside the training length at the
  longest evaluated length (LongLM's rule (L - w) * G + w >= the target length, plus one).

``TRAINED`` is one of the study's ``encodings`` specs, written the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError

#: evaluation-only rows added by default for each of these trained specs (when the study trains
#: it): the ExPE paper's Table 3 (ExPE/ExQPE evaluated at factor 2) and RoPE PI at inference
DEFAULT_EVAL_ONLY = {
    "expe": ['expe@{"scaling": {"type": "linear", "factor": 2}}'],
    "exqpe": ['exqpe@{"scaling": {"type": "linear", "factor": 2}}'],
    "rope": ["rope@interpolate", "rope@selfextend"],
}
INTERPOLATE = "interpolate"


def eval_only_rows(eval_only: list[str] | None, trained_specs: list[str]) -> list[str]:
    """The rows to evaluate: ``eval_only`` as given, or (None) the default rows of the trained specs."""
    if eval_only is None:
        return [row for spec, rows in DEFAULT_EVAL_ONLY.items() if spec in trained_specs for row in rows]
    return list(eval_only)


@dataclasses.dataclass(frozen=True)
class EvalOnly:
    """One evaluation-only row: the trained spec it evaluates and what changes at evaluation."""

    spec: str
    trained: str
    overrides: dict[str, Any] | None  # None: per-length interpolation (``@interpolate``)
    #: another encoding that extends the trained one (``TRAINED@NAME{...}``; overrides: its parameters)
    encoding: str | None = None

    def switch_params(self, train_length: int, longest: int) -> dict[str, Any]:
        """The parameters of :attr:`encoding`: the given ones, plus a ``window`` (training length / 2)
        and ``group_size`` (grouped distances inside the training length at ``longest``) left out."""
        from ...core.registry import get_encoding

        params = dict(self.overrides or {})
        names = get_encoding(str(self.encoding)).config_class.parameter_names()
        if "window" in names:
            params.setdefault("window", max(1, train_length // 2))
        if "group_size" in names and "group_size" not in params:
            window = params["window"]
            params["group_size"] = max(1, math.ceil((longest - window) / max(1, train_length - window)) + 1)
        return params

    def overrides_at(self, multiple: int) -> dict[str, Any]:
        """The parameters to set when evaluating at ``multiple`` x the training length."""
        if self.overrides is not None:
            return self.overrides
        return {"scaling": None if multiple == 1 else {"type": "linear", "factor": float(multiple)}}

    def label(self, train_length: int) -> str:
        from ..evaluation.labels import eval_override_text
        from .spec import display_label

        if self.encoding is not None:
            params = ", ".join(f"{k}={v}" for k, v in (self.overrides or {}).items())
            text = f"{self.encoding}{' ' + params if params else ''}, no training"
        elif self.overrides is None:
            text = f"PI at eval, factor = length/{train_length}"
        else:
            text = eval_override_text(self.overrides)
        trained = display_label(self.trained)
        return f"{trained[:-1]}; {text})" if trained.endswith(")") else f"{trained} ({text})"


def parse_eval_only(spec: str, trained_specs: list[str]) -> EvalOnly:
    """``TRAINED@OVERRIDES`` -> :class:`EvalOnly`; ``TRAINED`` must be one of ``trained_specs``."""
    for index, char in enumerate(spec):
        if char != "@" or spec[:index].strip() not in trained_specs:
            continue
        trained, rest = spec[:index].strip(), spec[index + 1 :].strip()
        if rest == INTERPOLATE:
            return EvalOnly(spec, trained, None)
        if rest and not rest.startswith("{"):
            return _switch_row(spec, trained, rest)
        try:
            overrides = json.loads(rest)
        except json.JSONDecodeError as error:
            raise InvalidParameterError(
                f"study: eval-only {spec!r}: {rest!r} is neither JSON nor {INTERPOLATE!r} ({error})"
            ) from None
        if not isinstance(overrides, dict) or not overrides:
            raise InvalidParameterError(
                f"study: eval-only {spec!r}: the overrides must be a non-empty JSON object, e.g. "
                '\'expe@{"scaling": {"type": "linear", "factor": 2}}\''
            )
        return EvalOnly(spec, trained, overrides)
    raise InvalidParameterError(
        f"study: eval-only {spec!r} is not allowed; allowed: TRAINED@{{JSON overrides}}, "
        f"TRAINED@{INTERPOLATE} or TRAINED@ENCODING{{JSON}} (an encoding that extends it, e.g. rope@selfextend), "
        f"where TRAINED is one of the study's encodings: {', '.join(trained_specs)}"
    )


def _switch_row(spec: str, trained: str, rest: str) -> EvalOnly:
    """``TRAINED@NAME{JSON}``: NAME must extend TRAINED's encoding (checked without a model)."""
    from ...core.registry import get_encoding
    from .spec import parse_encoding_spec

    name, params = parse_encoding_spec(rest)  # unknown names and bad JSON: one line
    trained_name, trained_params = parse_encoding_spec(trained)
    from ...core.registry import encoding_names

    config_class = get_encoding(name).config_class
    if config_class.extends != trained_name or not config_class.extends:
        takers = [n for n in encoding_names() if get_encoding(n).config_class.extends == trained_name]
        raise InvalidParameterError(
            f"study: eval-only {spec!r} is not allowed: {name} does not evaluate {trained_name} runs "
            f"without training; allowed after {trained_name}@: {', '.join(takers) or 'none'}"
        )
    shared = set(config_class.parameter_names())
    try:
        config_class.from_params({**{k: v for k, v in trained_params.items() if k in shared}, **params})
    except InvalidParameterError as error:
        raise InvalidParameterError(f"study: eval-only {spec!r}: {error}") from None
    return EvalOnly(spec, trained, params, encoding=name)


def check_eval_only(specs: list[str], trained_specs: list[str]) -> list[EvalOnly]:
    """Parse every row and validate its overrides against the trained encoding (no model needed)."""
    from ...core.request import check_overrides
    from .spec import parse_encoding_spec

    rows = [parse_eval_only(spec, trained_specs) for spec in specs]
    for row in rows:
        if row.encoding is not None:
            continue  # checked by _switch_row
        name, params = parse_encoding_spec(row.trained)
        overrides = row.overrides if row.overrides is not None else row.overrides_at(2)
        check_overrides(
            {"encoding": name, "params": params}, overrides, where=f"study: eval-only {row.spec!r}"
        )
    labels = [row.spec for row in rows]
    if len(set(labels)) != len(labels):
        raise InvalidParameterError(f"study: eval-only rows {labels} repeat a row")
    return rows


def base_label(config: Any) -> str:
    """The report's label of the untrained base row."""
    return "rope (base, no further training)" if not config.base_model else "base (no further training)"


def evaluate_study(config: Any, finals: dict[str, Path]) -> tuple[dict[str, list], list[str]]:
    """Loss at every length for the base model, each trained run and each evaluation-only row.

    Returns ``(results by label, labels of the evaluation-only rows)``."""
    from transformers import AutoTokenizer

    from ...core.loading import load_model
    from ...core.reconfiguration import reconfigure
    from ..data import read_documents, tokenize_documents
    from ..evaluation import check_model_length, evaluate_lengths, token_budget
    from ..threads import use_threads
    from .spec import display_label

    base = Path(config.base_model) if config.base_model else finals.pop("base (RoPE pretraining)")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    documents = read_documents(
        config.eval_data or config.data, text_field=config.text_field, split=config.eval_split
    )
    longest = config.train_length * max(config.multiples)
    tokens = tokenize_documents(documents, tokenizer, max_tokens=max(config.eval_tokens, longest))
    lengths = [config.train_length * m for m in config.multiples]
    tokens = tokens[: token_budget(tokens.numel(), lengths, config.eval_tokens)]  # every row reads these
    runs = {base_label(config): base}
    for spec, directory in finals.items():
        label = display_label(spec)
        runs[label if label not in runs else f"{label} [{spec}]"] = directory
    results: dict[str, list] = {}
    for label, directory in runs.items():
        model = load_model(str(directory)).eval()
        use_threads(config.threads, model)
        check_model_length(model, longest)
        print(f"[study] evaluating {label}")
        results[label] = evaluate_lengths(model, tokens, config.train_length, config.multiples, batch_size=8)
        del model
    eval_only: list[str] = []
    for row in check_eval_only(eval_only_rows(config.eval_only, config.encodings), list(config.encodings)):
        if row.encoding is not None:  # another encoding on the trained run, the same at every length
            params = row.switch_params(config.train_length, longest)
            row = dataclasses.replace(row, overrides=params)
            label = row.label(config.train_length)
            model = load_model(str(finals[row.trained]), row.encoding, params).eval()
            check_model_length(model, longest)
            print(f"[study] evaluating {label} (evaluation only, no training)")
            results[label] = evaluate_lengths(
                model, tokens, config.train_length, config.multiples, batch_size=8
            )
            eval_only.append(label)
            del model
            continue
        label = row.label(config.train_length)
        model = load_model(str(finals[row.trained])).eval()
        use_threads(config.threads, model)
        print(f"[study] evaluating {label} (evaluation only, no training)")
        rows = []
        for multiple in config.multiples:
            reconfigure(model, **row.overrides_at(multiple))
            check_model_length(model, config.train_length * multiple)
            rows += evaluate_lengths(model, tokens, config.train_length, [multiple], batch_size=8)
        results[label] = rows
        eval_only.append(label)
        del model
    return results, eval_only
