"""Benchmark presets, and lm-eval task configs that run the *packaged* task definitions.

:func:`plan_tasks` turns a task list or preset into one :class:`TaskRun` per lm-eval task,
checking everything up front (task and preset names, MMLU subjects, local files and their
row counts). :func:`write_task_configs` writes, for each run, a YAML that ``include:``s the
task's packaged YAML and sets ``num_fewshot``; with local data it also sets
``dataset_path: json``, ``dataset_name: null`` and ``dataset_kwargs.data_files``, and nulls
the splits whose file is absent. Task names stay those of lm-eval (``hellaswag``, ``mmlu``,
``mmlu_philosophy``, ...), so results read the same on hub and local data; load the folder
with ``TaskManager(include_path=folder, include_defaults=False)``.

Local data layout (rows in the hub datasets' own schemas, JSON lines or a JSON array)::

    DATA_DIR/hellaswag/{validation,train}.jsonl             Rowan/hellaswag
    DATA_DIR/arc_easy/{test,validation,train}.jsonl         allenai/ai2_arc ARC-Easy
    DATA_DIR/arc_challenge/{test,validation,train}.jsonl    allenai/ai2_arc ARC-Challenge
    DATA_DIR/mmlu/<subject>/{test,dev,validation}.jsonl     cais/mmlu <subject>

The evaluation split's file is required, and the few-shot split's file (train; dev for
MMLU) when ``num_fewshot > 0``, with at least ``num_fewshot + 1`` rows (lm-eval's random sampler
draws one more to leave out the evaluated row; ``num_fewshot`` for the ``first_n`` sampler).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...errors import PosencError
from .lm_eval_schema import check_rows

SUPPORTED_TASKS = ("hellaswag", "mmlu", "arc_easy", "arc_challenge")
#: preset -> {task: num_fewshot}
PRESETS: dict[str, dict[str, int]] = {
    "paper": {"hellaswag": 0, "mmlu": 0, "arc_easy": 0, "arc_challenge": 0},
    "leaderboard": {"hellaswag": 10, "mmlu": 5, "arc_easy": 25, "arc_challenge": 25},
}
PRESET_NOTES = {
    "paper": "0-shot on all four tasks (ExPE paper, Table 4)",
    "leaderboard": "HellaSwag 10-shot, ARC-Easy/ARC-Challenge 25-shot, MMLU 5-shot (Open LLM Leaderboard v1)",
}
DATA_SUFFIXES = (".jsonl", ".json")
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


class BenchmarkError(PosencError, ValueError):
    """A bad task, preset, subject or option for an lm-eval run."""


@dataclasses.dataclass(frozen=True)
class TaskRun:
    """One lm-eval task to write: its packaged YAML, shot count and (local) data files."""

    name: str
    include: Path
    num_fewshot: int
    data_files: dict[str, str] | None = None  # split -> file; None: the packaged (hub) dataset
    null_splits: tuple[str, ...] = ()  # split keys of the packaged YAML whose file is absent


def lm_eval_tasks_dir() -> Path:
    """The folder of lm-eval's packaged task definitions (lm-eval is not imported)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("lm-eval is not installed; run: pip install 'lm-eval>=0.4.13'")
    return Path(spec.origin).parent / "tasks"


def packaged_yaml(task: str) -> Path:
    """The packaged YAML of ``task`` (``hellaswag``, ``arc_easy``, ``arc_challenge`` or ``mmlu_<subject>``)."""
    root = lm_eval_tasks_dir()
    if task == "hellaswag":
        return root / "hellaswag" / "hellaswag.yaml"
    if task in ("arc_easy", "arc_challenge"):
        return root / "arc" / f"{task}.yaml"
    return root / "mmlu" / "default" / f"{task}.yaml"


def mmlu_subjects() -> list[str]:
    """Every MMLU subject lm-eval packages, e.g. ``abstract_algebra``."""
    return sorted(
        p.stem[len("mmlu_") :] for p in (lm_eval_tasks_dir() / "mmlu" / "default").glob("mmlu_*.yaml")
    )


def read_task_yaml(path: Path) -> dict[str, Any]:
    """A packaged task YAML with its ``include:``s merged (``!function`` values kept as text)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    with path.open(encoding="utf-8") as handle:
        config = yaml.load(handle, Loader=Loader)  # a SafeLoader that also reads !function
    merged: dict[str, Any] = {}
    includes = config.pop("include", [])
    for include in [includes] if isinstance(includes, str) else includes:
        merged.update(read_task_yaml(path.parent / include))
    merged.update(config)
    return merged


def split_roles(config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(evaluation split, few-shot split) of a task config, by lm-eval's rules."""
    evaluation = config.get("test_split") or config.get("validation_split")
    fewshot = config.get("fewshot_split") or config.get("training_split") or config.get("validation_split")
    return evaluation, fewshot


def _close(name: str, allowed: Sequence[str]) -> str:
    matches = difflib.get_close_matches(name, list(allowed), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(map(repr, matches))}?" if matches else ""


def select_tasks(
    tasks: Sequence[str] | None, preset: str | None, num_fewshot: int | None = None
) -> dict[str, int]:
    """``{task: num_fewshot}``: a preset's shots (for ``tasks`` only, when given), else ``num_fewshot`` (0)."""
    if preset is not None and preset not in PRESETS:
        allowed = "; ".join(f"{name} ({note})" for name, note in PRESET_NOTES.items())
        raise BenchmarkError(f"unknown preset {preset!r}.{_close(preset, list(PRESETS))} Allowed: {allowed}")
    if preset is not None and num_fewshot is not None:
        raise BenchmarkError(
            f"--num_fewshot cannot be combined with --preset {preset} (the preset sets each task's shots)"
        )
    names = list(tasks) if tasks else list(PRESETS[preset]) if preset else []
    if not names:
        raise BenchmarkError(
            f"no tasks: give --preset {' or '.join(PRESETS)}, or --tasks {' '.join(SUPPORTED_TASKS)}"
        )
    for name in names:
        if name.startswith("mmlu_") and name[len("mmlu_") :] in mmlu_subjects():
            raise BenchmarkError(
                f"for one MMLU subject give --tasks mmlu --mmlu-subjects {name[len('mmlu_') :]}"
            )
        if name not in SUPPORTED_TASKS:
            raise BenchmarkError(
                f"unknown task {name!r}.{_close(name, SUPPORTED_TASKS)} Allowed: {', '.join(SUPPORTED_TASKS)} "
                "(for other lm-eval tasks run plain `hf-posenc lm-eval --model hf-posenc --model_args ... --tasks ...`)"
            )
    if num_fewshot is not None and num_fewshot < 0:
        raise BenchmarkError(f"--num_fewshot={num_fewshot} must be >= 0")
    return {name: PRESETS[preset][name] if preset else (num_fewshot or 0) for name in dict.fromkeys(names)}


def select_mmlu_subjects(requested: Sequence[str] | None, data_dir: Path | None) -> list[str]:
    """The MMLU subjects to run: ``requested``, else those present under ``data_dir/mmlu``, else all."""
    known = mmlu_subjects()
    for subject in requested or []:
        if subject not in known:
            raise BenchmarkError(
                f"unknown MMLU subject {subject!r}.{_close(subject, known)} Allowed: {', '.join(known)}"
            )
    if data_dir is None:
        return list(dict.fromkeys(requested)) if requested else known
    root = data_dir / "mmlu"
    present = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    strange = [name for name in present if name not in known]
    if strange:
        raise BenchmarkError(
            f"{root / strange[0]} is not an MMLU subject folder; allowed names: {', '.join(known)}"
        )
    if requested:
        return list(dict.fromkeys(requested))
    if not present:
        raise FileNotFoundError(
            f"no MMLU subjects under {root} (expected {root}/<subject>/test.jsonl, e.g. {root}/anatomy/test.jsonl)"
        )
    return present


def _data_file(folder: Path, split: str) -> Path | None:
    for suffix in DATA_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    return None


def _local_run(name: str, include: Path, shots: int, folder: Path) -> TaskRun:
    config = read_task_yaml(include)
    evaluation, fewshot = split_roles(config)
    needed = {evaluation: "evaluation"}
    if shots > 0 and fewshot is not None:
        needed.setdefault(fewshot, f"{shots}-shot examples")
    data_files: dict[str, str] = {}
    null_splits = []
    for key in SPLIT_KEYS:
        split = config.get(key)
        if not split:
            continue
        path = _data_file(folder, split)
        if path is None:
            if split in needed:
                raise FileNotFoundError(
                    f"{name}: missing {folder / (split + '.jsonl')} (the {split!r} split, used for "
                    f"{needed[split]}); the local layout is described in `hf-posenc lm-eval --help`"
                )
            null_splits.append(key)
        else:
            data_files[split] = str(path.resolve())
    counts = {split: check_rows(name, Path(path)) for split, path in data_files.items()}  # schema, row by row
    # lm-eval's random sampler draws shots + 1 rows (to leave out the evaluated one); first_n takes shots
    sampler = (config.get("fewshot_config") or {}).get("sampler", "default")
    need = shots if sampler == "first_n" else shots + 1
    if shots > 0 and fewshot is not None and (rows := counts[fewshot]) < need:
        raise BenchmarkError(
            f"{name}: {shots}-shot needs at least {need} rows in {data_files[fewshot]} (lm-eval's "
            f"{sampler} sampler), found {rows}"
        )
    return TaskRun(name, include, shots, data_files, tuple(null_splits))


def plan_tasks(
    shots: Mapping[str, int], data_dir: str | Path | None = None, subjects: Sequence[str] | None = None
) -> list[TaskRun]:
    """One :class:`TaskRun` per lm-eval task (MMLU: one per subject), all inputs checked."""
    folder = None
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"--data-dir {str(data_dir)!r} is not a directory")
    runs = []
    for task, count in shots.items():
        names = [f"mmlu_{s}" for s in select_mmlu_subjects(subjects, folder)] if task == "mmlu" else [task]
        for name in names:
            include = packaged_yaml(name)
            if folder is None:
                runs.append(TaskRun(name, include, count))
                continue
            data = folder / "mmlu" / name[len("mmlu_") :] if task == "mmlu" else folder / task
            runs.append(_local_run(name, include, count, data))
    return runs


def _mmlu_groups(runs: Sequence[TaskRun]) -> dict[str, dict[str, Any]]:
    """Group configs reproducing lm-eval's ``mmlu`` hierarchy over the subjects in ``runs``."""
    mmlu_dir = lm_eval_tasks_dir() / "mmlu" / "default"
    categories = []
    for run in runs:
        if run.name.startswith("mmlu_"):
            tag = read_task_yaml(run.include)["tag"]  # e.g. mmlu_stem_tasks
            categories.append(tag[: -len("_tasks")])
    if not categories:
        return {}
    top = read_task_yaml(mmlu_dir / "_mmlu.yaml")
    present = [c for c in top["task"] if c in categories]
    groups: dict[str, dict[str, Any]] = {c: {"include": str(mmlu_dir / f"_{c}.yaml")} for c in present}
    groups["mmlu"] = {"include": str(mmlu_dir / "_mmlu.yaml"), "task": present}
    return groups


def write_task_configs(runs: Sequence[TaskRun], folder: str | Path) -> list[str]:
    """Write one YAML per run (and the MMLU groups) into ``folder``; return the names to evaluate."""
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for run in runs:
        config: dict[str, Any] = {
            "include": str(run.include),
            "task": run.name,
            "num_fewshot": run.num_fewshot,
        }
        if run.data_files is not None:
            config.update(
                dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": run.data_files}
            )
            config.update({key: None for key in run.null_splits})
        (folder / f"{run.name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    groups = _mmlu_groups(runs)
    for name, config in groups.items():
        (folder / f"_{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    names = [run.name for run in runs if not run.name.startswith("mmlu_")]
    if groups:
        position = next(i for i, run in enumerate(runs) if run.name.startswith("mmlu_"))
        names.insert(position, "mmlu")
    return names
