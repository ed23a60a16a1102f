"""The study's evaluation: every trained run, plus evaluation-only rows.

An evaluation-only row takes a run the study trained and evaluates it with inference-time
encoding parameters changed (:func:`hf_posenc.reconfigure`), without any further training —
the shape of the ExPE paper's Table 3 (ExPE/ExQPE trained unscaled, evaluated "scaled by
0.5", i.e. positions divided by 2) and of position interpolation at inference for RoPE (Chen
et al. 2023, arXiv:2306.15595). A row is written ``TRAINED@OVERRIDES``:

- ``'expe@{"scaling": {"type": "linear", "factor": 2}}'`` — the overrides (JSON) at every length;
- ``rope@interpolate`` — linear interpolation with factor = evaluation length / training length
  at each length (1 at 1x, 16 at 16x), so every length maps onto the trained positions.

``TRAINED`` is one of the study's ``encodings`` specs, written the same way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError

#: evaluation-only rows added by default for each of these trained specs (when the study trains
#: it): the ExPE paper's Table 3 (ExPE/ExQPE evaluated at factor 2) and RoPE PI at inference
DEFAULT_EVAL_ONLY = {
    "expe": 'expe@{"scaling": {"type": "linear", "factor": 2}}',
    "exqpe": 'exqpe@{"scaling": {"type": "linear", "factor": 2}}',
    "rope": "rope@interpolate",
}
INTERPOLATE = "interpolate"


def eval_only_rows(eval_only: list[str] | None, trained_specs: list[str]) -> list[str]:
    """The rows to evaluate: ``eval_only`` as given, or (None) the default rows of the trained specs."""
    if eval_only is None:
        return [row for spec, row in DEFAULT_EVAL_ONLY.items() if spec in trained_specs]
    return list(eval_only)


@dataclasses.dataclass(frozen=True)
class EvalOnly:
    """One evaluation-only row: the trained spec it evaluates and what changes at evaluation."""

    spec: str
    trained: str
    overrides: dict[str, Any] | None  # None: per-length interpolation (``@interpolate``)

    def overrides_at(self, multiple: int) -> dict[str, Any]:
        """The parameters to set when evaluating at ``multiple`` x the training length."""
        if self.overrides is not None:
            return self.overrides
        return {"scaling": None if multiple == 1 else {"type": "linear", "factor": float(multiple)}}

    def label(self, train_length: int) -> str:
        from ..evaluation.labels import eval_override_text
        from .spec import display_label

        if self.overrides is None:
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
        f"study: eval-only {spec!r} is not allowed; allowed: TRAINED@{{JSON overrides}} or "
        f"TRAINED@{INTERPOLATE}, where TRAINED is one of the study's encodings: {', '.join(trained_specs)}"
    )


def check_eval_only(specs: list[str], trained_specs: list[str]) -> list[EvalOnly]:
    """Parse every row and validate its overrides against the trained encoding (no model needed)."""
    from ...core.request import check_overrides
    from .spec import parse_encoding_spec

    rows = [parse_eval_only(spec, trained_specs) for spec in specs]
    for row in rows:
        name, params = parse_encoding_spec(row.trained)
        overrides = row.overrides if row.overrides is not None else row.overrides_at(2)
        check_overrides(
            {"encoding": name, "params": params}, overrides, where=f"study: eval-only {row.spec!r}"
        )
    labels = [row.spec for row in rows]
    if len(set(labels)) != len(labels):
        raise InvalidParameterError(f"study: eval-only rows {labels} repeat a row")
    return rows


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
    runs = {
        "rope (base, no further training)" if not config.base_model else "base (no further training)": base
    }
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
