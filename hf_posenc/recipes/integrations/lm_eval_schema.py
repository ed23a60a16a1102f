"""Row schemas of the local benchmark files, checked before any model loads.

Each task's packaged YAML reads specific fields (HellaSwag: ``utils.process_docs`` and
``{{label}}``; ARC: ``choices.label.index(answerKey)``; MMLU: ``choices[0..3]`` and ``answer``
as the index of the gold choice). A row that deviates would crash lm-eval after the model has
loaded, or — an MMLU ``answer`` stored as the string ``"0"`` — be scored as wrong without a
word. :func:`check_rows` reads a whole file and names the first bad row by file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...errors import PosencError


class SchemaError(PosencError, ValueError):
    """A row of a local benchmark file does not have its task's schema."""


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _str_list(value: Any, length: int | None = None) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(v, str) for v in value)
        and len(value) >= 2
        and (length is None or len(value) == length)
    )


def _hellaswag(row: dict) -> str | None:
    for field in ("activity_label", "ctx_a", "ctx_b"):
        if not _is_str(row.get(field)):
            return f"field {field!r} must be a string, got {json.dumps(row.get(field))}"
    endings = row.get("endings")
    if not isinstance(endings, list) or not _str_list(endings):
        return f"field 'endings' must be a list of at least 2 strings, got {json.dumps(endings)[:80]}"
    label = row.get("label")
    allowed = [str(i) for i in range(len(endings))]
    if isinstance(label, bool) or str(label) not in allowed or not isinstance(label, (int, str)):
        return f"field 'label' must be the index of the right ending ({', '.join(allowed)}), got {json.dumps(label)}"
    return None


def _arc(row: dict) -> str | None:
    if not _is_str(row.get("question")):
        return f"field 'question' must be a string, got {json.dumps(row.get('question'))}"
    choices = row.get("choices")
    if (
        not isinstance(choices, dict)
        or not _str_list(choices.get("text"))
        or not _str_list(choices.get("label"))
    ):
        return (
            'field \'choices\' must be {"text": [strings], "label": [strings]}, '
            f"got {json.dumps(choices)[:80]}"
        )
    if len(choices["text"]) != len(choices["label"]):
        return f"choices.text has {len(choices['text'])} entries but choices.label {len(choices['label'])}"
    if row.get("answerKey") not in choices["label"]:
        return (
            f"field 'answerKey' must be one of choices.label ({', '.join(choices['label'])}), "
            f"got {json.dumps(row.get('answerKey'))}"
        )
    return None


def _mmlu(row: dict) -> str | None:
    if not _is_str(row.get("question")):
        return f"field 'question' must be a string, got {json.dumps(row.get('question'))}"
    if not _str_list(row.get("choices"), 4):
        return f"field 'choices' must be a list of 4 strings, got {json.dumps(row.get('choices'))[:80]}"
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer <= 3:
        hint = " (a number, not a string)" if isinstance(answer, str) else ""
        return f"field 'answer' must be the integer 0, 1, 2 or 3{hint}, got {json.dumps(answer)}"
    return None


SCHEMAS: dict[str, Callable[[dict], str | None]] = {
    "hellaswag": _hellaswag,
    "arc_easy": _arc,
    "arc_challenge": _arc,
    "mmlu": _mmlu,
}


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) of a JSON-lines file or a JSON array; where is ``line N`` or ``row N``."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line = raw[: error.start].count(b"\n") + 1
        raise SchemaError(f"{path}:{bad_line}: not UTF-8 text") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise SchemaError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
        for row_number, row in enumerate(rows, 1):
            yield f"row {row_number}", row
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield str(number), json.loads(line)
        except json.JSONDecodeError as error:
            raise SchemaError(
                f"{path}:{number}: not a JSON value ({error.msg}, column {error.colno})"
            ) from None


def check_rows(task: str, path: Path) -> int:
    """Check every row of ``path`` against ``task``'s schema (``mmlu`` for any subject); return the count."""
    check = SCHEMAS["mmlu" if task.startswith("mmlu") else task]
    count = 0
    for where, row in _rows(path):
        if not isinstance(row, dict):
            raise SchemaError(f"{path}:{where}: the row is a JSON {type(row).__name__}; allowed: an object")
        problem = check(row)
        if problem:
            raise SchemaError(f"{path}:{where}: {problem} (the schema of the hub dataset for {task})")
        count += 1
    return count
