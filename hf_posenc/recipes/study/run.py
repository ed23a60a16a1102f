"""The extrapolation study: one base checkpoint, several encodings, one report.

For a base checkpoint and a list of encodings: patch each, continue pretraining it for the
same number of steps on the same data, then measure the loss at 1x, 2x, 4x, 8x and 16x the
training length on held-out text — the shape of the ExPE paper's Table 1 — as a table,
CSV/JSON and a plot. Evaluation-only rows (:mod:`hf_posenc.recipes.study.evaluate`) evaluate trained runs
with inference-time parameters changed, e.g. ExPE/ExQPE at scaling factor 2 (the paper's
Table 3) and RoPE with position interpolation at each length.

With no base checkpoint, the embedded default runs offline: the Python standard library's
sources as the corpus, a byte-level BPE tokenizer trained on them, and a tiny Llama first
pretrained with RoPE to play the pretrained checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError, PosencError
from ..atomic import write_text
from .spec import StudyConfig, parse_encoding_spec, spec_slug


class _Progress:
    """``[k/N]`` lines with elapsed time and an ETA from the training steps done so far."""

    def __init__(self, phases: int, steps_to_train: int) -> None:
        self.phases, self.remaining = phases, steps_to_train
        self.number, self.done, self.start = 0, 0, time.monotonic()

    def phase(self, message: str, steps: int = 0) -> None:
        self.number += 1
        elapsed = time.monotonic() - self.start
        eta = ""
        if self.done and self.remaining:
            eta = f", ETA {_duration(elapsed / self.done * self.remaining)}"
        print(
            f"[study {self.number}/{self.phases}] {message} (elapsed {_duration(elapsed)}{eta})", flush=True
        )
        self._pending = steps

    def finished(self) -> None:
        self.done += self._pending
        self.remaining -= self._pending
        self._pending = 0


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def check_study(config: StudyConfig) -> Path:
    """Every check that needs no model: output folder, base model, encodings, parameters, data."""
    from ..data import check_sources, is_local
    from ..evaluation.report import check_output_dir
    from ..preflight import check_encoding, check_model_path

    out = check_output_dir(config.output_dir)
    saved = None
    if config.base_model:
        saved = check_model_path(config.base_model, what="--base-model", need_tokenizer=True)
        if saved and saved.get("posenc"):
            from ...core.request import check_saved_entry, saved_description

            check_saved_entry(saved["posenc"], "study: --base-model")  # a hand-edited entry: one line
            raise InvalidParameterError(
                f"study: --base-model {config.base_model!r} is already patched with "
                f"{saved_description(saved['posenc'])!r}; start from the original (unpatched) checkpoint"
            )
    slugs: dict[str, str] = {}
    for spec in config.encodings:
        name, params = parse_encoding_spec(spec)
        check_encoding(name, params, saved, where=f"study: encoding {spec!r}")
        check_row_sampling(spec, name, params)
        if spec_slug(spec) in slugs:
            raise InvalidParameterError(
                f"study: encodings {slugs[spec_slug(spec)]!r} and {spec!r} share the run folder {spec_slug(spec)!r}"
            )
        slugs[spec_slug(spec)] = spec
    from .evaluate import check_eval_only, eval_only_rows

    check_eval_only(eval_only_rows(config.eval_only, config.encodings), list(config.encodings))
    check_sources(config.data)
    check_sources(config.eval_data or config.data)
    if config.eval_data is None and any(is_local(s) for s in config.data):
        # (a local file has no validation split: its "validation" is the whole file, the training text)
        raise InvalidParameterError(
            f"study: --data {list(config.data)} holds local files, which have no held-out split: the losses "
            "would be measured on the training text; allowed: --eval-data SRC (held-out text), or --data "
            "sources with a validation split (builtin:stdlib, hf:NAME)"
        )
    if not config.base_model:
        _check_embedded_base(config)
    _check_retrieval_length(config)
    return out


#: attention heads of the embedded base model (the tiny Llama the study pretrains)
BASE_HEADS = 4


def _check_embedded_base(config: StudyConfig) -> None:
    """The embedded base model's settings, before its tokenizer is trained: a vocabulary the
    tokenizer can train, a model of ``hidden_size`` / ``num_layers`` that its family builds
    (:func:`..benchmark.model_check.check_model_flags`), and every encoding of the study, with
    its parameters, patching it (``check_patch_fits``, as a given base model's config is checked)."""
    from ...core.plan import check_patch_fits
    from ...models import DEFAULT_FAMILY
    from ..benchmark.model_check import check_model_flags
    from ..tokenizer import MIN_VOCAB_SIZE

    if config.vocab_size < MIN_VOCAB_SIZE:
        raise InvalidParameterError(
            f"study: vocab_size={config.vocab_size} is not allowed; allowed: an integer >= {MIN_VOCAB_SIZE} "
            "(the byte-level tokenizer's 256 bytes, merges and special tokens)"
        )
    model_config = check_model_flags(
        DEFAULT_FAMILY,
        [],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=BASE_HEADS,
        max_positions=config.train_length * max(config.multiples),
        named=f"study: the embedded base model (hidden_size={config.hidden_size}, {BASE_HEADS} heads)",
    )
    for spec in config.encodings:
        name, params = parse_encoding_spec(spec)
        try:
            check_patch_fits(model_config, name, params)
        except PosencError as error:
            raise type(error)(f"study: encoding {spec!r}: {error}") from None


def _check_retrieval_length(config: StudyConfig) -> None:
    """A training length too short for the passkey documents is refused here, before any tokenizer is
    trained or file written: exactly with a given base model's tokenizer, else by a bound every
    byte-level BPE tokenizer obeys (the exact check runs again once the study's tokenizer exists)."""
    if not config.retrieval_documents:
        return
    from .retrieval import check_training_length, check_training_length_early

    if config.base_model:
        from transformers import AutoTokenizer

        check_training_length(config, AutoTokenizer.from_pretrained(config.base_model))
    else:
        check_training_length_early(config)


def _resumed_or_retrained(run: Callable[[], Any], retrain: Callable[[], Any], overwrite: bool) -> Any:
    """``run()``; an interrupted run whose data's tokens changed since it started (train's
    :class:`~..training.world.DataChangedError` on resume) is trained again from the start with
    ``overwrite``, else refused in the study's words."""
    from ..training.world import DataChangedError

    try:
        return run()
    except DataChangedError as error:
        if not overwrite:
            raise InvalidParameterError(
                f"study: the interrupted run in {str(error.checkpoint.parent)!r} was made with other settings: "
                f"training data: {error.change}; pass --overwrite to train it again, or restore the data"
            ) from None
        return retrain()


def _pretrain_base(config: StudyConfig, settings, status: str):
    """Train the tokenizer and pretrain the embedded tiny Llama with RoPE; return its final folder."""
    from ...models import DEFAULT_FAMILY
    from ..data import read_documents
    from ..tiny import tiny_model
    from ..tokenizer import train_bpe_tokenizer
    from ..training import train

    documents = read_documents(
        config.data, text_field=config.text_field, split=config.train_split, limit=config.max_documents
    )
    tokenizer = train_bpe_tokenizer(documents, vocab_size=config.vocab_size)
    from .retrieval import write_training_documents

    write_training_documents(
        config, tokenizer
    )  # the passkey documents listed first in the data, if asked for
    model = tiny_model(
        DEFAULT_FAMILY,
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=BASE_HEADS,
        num_kv_heads=BASE_HEADS,
        max_positions=config.train_length * max(config.multiples),
        seed=config.seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return train(
        settings, model=model, tokenizer=tokenizer, resume=status == "resume", overwrite=status == "retrain"
    ).final_dir


def run_study(config: StudyConfig, *, overwrite: bool = False, dry_run: bool = False) -> dict[str, Path]:
    """Run the whole study (reusing finished runs, resuming interrupted ones); returns the report files.
    A second study into the same output folder, while this one runs, is refused (``run_lock``)."""
    from .. import run_lock

    out = check_study(config)
    if dry_run:
        return _run_study(config, out, overwrite, dry_run)
    run_lock.acquire(out, "study")
    try:
        return _run_study(config, out, overwrite, dry_run)
    finally:
        run_lock.release(out)


def _run_study(config: StudyConfig, out: Path, overwrite: bool, dry_run: bool) -> dict[str, Path]:
    from ..provenance import provenance
    from .runs import plan_study

    plan = plan_study(config, overwrite, check_data=not dry_run)  # a dry run reads no data
    if dry_run:
        print(f"[study] dry run: every input is valid; output in {out}")
        for label, settings, status in plan:
            print(f"  {status:<8} {label}: {settings.max_steps} steps -> {settings.output_dir}")
        print(f"  evaluate at {', '.join(str(config.train_length * m) for m in config.multiples)} tokens")
        if config.retrieval_documents:
            instruction = "" if config.retrieval_instruction else ", no instruction line"
            print(
                f"  passkey retrieval: {config.retrieval_documents} training documents (keys "
                f"1-{config.retrieval_max_key}{instruction}) in every pretraining, {config.retrieval_samples} "
                "prompts per length and depth (--retrieval-documents 0: none)"
            )
        from .evaluate import eval_only_rows

        for spec in eval_only_rows(config.eval_only, config.encodings):
            print(f"  evaluate only {spec} (no training)")
        return {}
    write_text(out / "study_config.json", json.dumps(dataclasses.asdict(config), indent=2))
    to_train = sum(s.max_steps for _, s, status in plan if status != "reuse")
    progress = _Progress(len(plan) + 1 + (1 if config.retrieval_documents else 0), to_train)
    finals: dict[str, Path] = {}
    try:
        for label, settings, status in plan:
            verb = {"reuse": "reusing", "resume": "resuming", "train": "training", "retrain": "retraining"}[
                status
            ]
            steps = 0 if status == "reuse" else settings.max_steps
            progress.phase(f"{label}: {verb} ({settings.max_steps} steps) in {settings.output_dir}", steps)
            if status == "reuse":
                finals[label] = Path(settings.output_dir) / "final"
            elif label.startswith("base"):
                finals[label] = _resumed_or_retrained(
                    functools.partial(_pretrain_base, config, settings, status),
                    functools.partial(_pretrain_base, config, settings, "retrain"),
                    overwrite,
                )
            else:
                from ..training import train

                _ensure_retrieval_documents(config, finals)
                finals[label] = _resumed_or_retrained(
                    functools.partial(
                        train, settings, resume=status == "resume", overwrite=status == "retrain"
                    ),
                    functools.partial(train, settings, overwrite=True),
                    overwrite,
                ).final_dir
            progress.finished()
    except KeyboardInterrupt as stop:
        raise KeyboardInterrupt(f"{stop or 'stopped'}; run the same command again to continue") from None
    from .evaluate import eval_only_rows, evaluate_study

    trained = dict(finals)  # evaluate_study takes the base out of finals
    extra = len(eval_only_rows(config.eval_only, config.encodings))
    rows = len(finals) + (1 if config.base_model else 0) + extra
    progress.phase(f"evaluating {rows} rows ({extra} evaluation-only)")
    results, eval_only = evaluate_study(config, finals)
    title = f"Loss vs evaluation length (trained at {config.train_length} tokens, {config.steps} steps each)"
    from ..evaluation import format_table, write_report
    from ..evaluation.ranking import result_warnings, study_warnings
    from .evaluate import base_label

    kinds = {base_label(config): "base", **{label: "eval-only" for label in eval_only}}
    warnings = study_warnings(config.steps, None if config.base_model else config.pretrain_steps)
    paths = write_report(
        results,
        out,
        config.train_length,
        title,
        metadata={
            "study": dataclasses.asdict(config),
            "provenance": provenance(),
            "eval_only_rows": eval_only,
        },
        kinds=kinds,
        warnings=warnings,
    )
    print(format_table(results, kinds=kinds, warnings=[*warnings, *result_warnings(results)]))
    print(f"[study] report: {', '.join(str(p) for p in paths.values())}")
    if config.retrieval_documents:
        progress.phase(f"passkey retrieval of {len(trained) + (1 if config.base_model else 0)} rows")
        paths.update(_retrieval(config, trained))
    return paths


def _base_dir(config: StudyConfig, finals: dict[str, Path]) -> Path:
    return Path(config.base_model) if config.base_model else finals["base (RoPE pretraining)"]


def _ensure_retrieval_documents(config: StudyConfig, finals: dict[str, Path]) -> None:
    """The passkey documents exist before a continued pretraining reads its data (written with the
    base model's tokenizer when the base was reused or given)."""
    if config.retrieval_documents:
        from transformers import AutoTokenizer

        from .retrieval import write_training_documents

        write_training_documents(config, AutoTokenizer.from_pretrained(str(_base_dir(config, finals))))


def _retrieval(config: StudyConfig, trained: dict[str, Path]) -> dict[str, Path]:
    """Passkey accuracy of the base and every trained run at every evaluation length: table and picture."""
    from transformers import AutoTokenizer

    from ..provenance import provenance
    from .evaluate import base_label
    from .retrieval import evaluate_retrieval, write_retrieval_report
    from .spec import display_label

    base = _base_dir(config, trained)
    runs = {base_label(config): base}
    runs.update({display_label(spec): path for spec, path in trained.items() if not spec.startswith("base")})
    results = evaluate_retrieval(config, runs, AutoTokenizer.from_pretrained(str(base)))
    return write_retrieval_report(config, results, {"provenance": provenance()})


def check_row_sampling(spec: str, name: str, params: dict) -> None:
    """A ``~pose`` / ``~randomized`` row of an encoding that reads no position ids: one line, before
    anything trains (asked of the encoding; parameters that may change it are checked at training)."""
    from ...core.registry import get_encoding
    from .spec import row_sampling

    sampling = row_sampling(spec)[1]
    if sampling != "none" and not params and not get_encoding(name).reads_positions:
        raise InvalidParameterError(
            f"study: row {spec!r}: position sampling is not allowed with {name!r}, whose attention reads no "
            "position ids; allowed: ~pose / ~randomized after an encoding that reads position ids"
        )
