"""The study's runs: the training settings of each, and what to do with what is on disk
(reuse a finished run, resume an interrupted one, train, or retrain with ``--overwrite``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ...errors import InvalidParameterError
from ...models import DEFAULT_FAMILY
from .retrieval import training_source
from .spec import StudyConfig, parse_encoding_spec, row_sampling, spec_slug


def _tiny_spec(config: StudyConfig) -> str:
    """The embedded base model as a model "name" that records everything that shapes it."""
    return (
        f"builtin:tiny-{DEFAULT_FAMILY}(hidden={config.hidden_size},layers={config.num_layers},vocab={config.vocab_size},"
        f"positions={config.train_length * max(config.multiples)},seed={config.seed})"
    )


def _base_settings(config: StudyConfig, out: Path):
    from ..training import TrainConfig

    return TrainConfig(
        model=_tiny_spec(config),
        output_dir=str(out / "base"),
        data=[*training_source(config), *config.data],
        split=config.train_split,
        text_field=config.text_field,
        max_documents=config.max_documents,
        seq_len=config.train_length,
        batch_size=config.batch_size,
        max_steps=config.pretrain_steps,
        lr=config.lr,
        log_every=max(1, config.pretrain_steps // 10),
        save_every=max(1, config.pretrain_steps // 10),
        keep_checkpoints=1,
        seed=config.seed,
        data_cache=str(out / "data-cache"),
        threads=config.threads,
        packing=config.packing,
        report_to=list(config.report_to),
    )


def _run_settings(config: StudyConfig, base: Path, spec: str, out: Path):
    from ..training import TrainConfig

    name, params = parse_encoding_spec(spec)
    sampling = row_sampling(spec)[1]
    return TrainConfig(
        model=str(base),
        output_dir=str(out / "runs" / spec_slug(spec)),
        data=[*training_source(config), *config.data],
        split=config.train_split,
        text_field=config.text_field,
        max_documents=config.max_documents,
        encoding=name,
        encoding_params=params,
        seq_len=config.train_length,
        batch_size=config.batch_size,
        max_steps=config.steps,
        lr=config.lr,
        warmup_ratio=0.1,
        log_every=max(1, config.steps // 5),
        save_every=max(1, config.steps // 10),
        keep_checkpoints=1,
        seed=config.seed,
        data_cache=str(out / "data-cache"),
        threads=config.threads,
        packing=config.packing,
        report_to=list(config.report_to),
        position_sampling=sampling,
        target_length=None if sampling == "none" else config.train_length * max(config.multiples),
    )


def _recorded_config(run: Path) -> dict[str, Any] | None:
    """The training settings a finished run recorded (None if it recorded none)."""
    for file, key in ((run / "final" / "training_run.json", "config"), (run / "train_config.json", None)):
        if file.is_file():
            try:
                record = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            return record[key] if key else record
    return None


def run_status(settings, overwrite: bool = False, *, check_data: bool = False) -> str:
    """What the study does with a run: ``reuse``, ``resume``, ``train`` or ``retrain`` (--overwrite).

    A finished or interrupted run whose recorded settings differ from ``settings`` is an error
    (naming each difference) unless ``overwrite``; with ``check_data``, so is a finished run
    whose training data's tokens are not the data's now (a data file edited since: the
    settings name the same file). An interrupted run's tokens are checked when it resumes."""
    from ..training.checkpoints import checkpoint_dirs, read_state
    from ..training.guards import resume_differences

    run = Path(settings.output_dir)
    current = dataclasses.asdict(settings)
    if (run / "final" / "config.json").is_file():
        recorded = _recorded_config(run)
        changed = ["no recorded settings"] if recorded is None else resume_differences(recorded, current)
        what = "finished"
    elif checkpoint_dirs(run):
        try:
            changed = resume_differences(read_state(checkpoint_dirs(run)[-1])["config"], current)
        except (OSError, KeyError, json.JSONDecodeError):
            changed = []  # a damaged checkpoint: train() falls back to an intact one, or says why not
        what = "interrupted"
    else:
        return "train"
    if not changed and what == "finished" and check_data:
        changed = data_change(settings, run)
    if not changed:
        return "reuse" if what == "finished" else "resume"
    if overwrite:
        return "retrain"
    raise InvalidParameterError(
        f"study: the {what} run in {str(run)!r} was made with other settings: {', '.join(changed)}; "
        "pass --overwrite to train it again, or choose another --output-dir"
    )


def data_change(settings, run: Path) -> list[str]:
    """[what changed] when the finished ``run`` recorded other training tokens than ``settings``'
    data gives now with the run's own tokenizer (through the study's shared token cache: a
    cache hit when nothing changed), else []. A run that recorded none is not checked."""
    try:
        recorded = json.loads((run / "final" / "training_run.json").read_text(encoding="utf-8"))[
            "training_data"
        ]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return []
    if recorded is None:
        return []
    from ..data import DataError
    from ..training.world import describe_data_change

    try:
        current = _fingerprint_now(settings, run)
    except (DataError, FileNotFoundError):
        return []  # a source gone (the study's generated passkey file): train writes it again
    return [] if current == recorded else [f"training data: {describe_data_change(recorded, current)}"]


def _fingerprint_now(settings, run: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from ..training.corpus import run_blocks

    return run_blocks(settings, AutoTokenizer.from_pretrained(run / "final"), run).fingerprint


def plan_study(
    config: StudyConfig, overwrite: bool = False, *, check_data: bool = False
) -> list[tuple[str, Any, str]]:
    """(label, training settings, status) of every run, checked against what is on disk (with
    ``check_data``, finished runs against the data's tokens too: :func:`run_status`)."""
    out = Path(config.output_dir)
    plan = []
    base = Path(config.base_model) if config.base_model else out / "base" / "final"
    if not config.base_model:
        settings = _base_settings(config, out)
        plan.append(
            ("base (RoPE pretraining)", settings, run_status(settings, overwrite, check_data=check_data))
        )
    fresh_base = bool(plan) and plan[0][2] in ("train", "retrain")
    for spec in config.encodings:
        settings = _run_settings(config, base, spec, out)
        status = run_status(settings, overwrite, check_data=check_data)
        if fresh_base and status in ("reuse", "resume"):
            if not overwrite:
                raise InvalidParameterError(
                    f"study: {settings.output_dir!r} was trained from a base model that is not there any more "
                    "(the base is trained anew); pass --overwrite to train it again, or choose another --output-dir"
                )
            status = "retrain"
        plan.append((spec, settings, status))
    return plan
