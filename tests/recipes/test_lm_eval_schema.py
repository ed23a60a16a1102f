"""Local benchmark files are checked row by row against their task's schema before any model
loads: a deviating row is named by file and line instead of crashing lm-eval after the model
has loaded, or (an MMLU answer stored as the string "0") being scored as wrong in silence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_posenc.recipes.cli import main
from hf_posenc.recipes.integrations.lm_eval_schema import SchemaError, check_rows
from hf_posenc.recipes.integrations.lm_eval_tasks import plan_tasks

FIXTURES = Path(__file__).parents[1] / "fixtures" / "lm_eval"


def test_every_fixture_file_in_the_hub_schemas_passes():
    """The fixtures are rows copied in the hub datasets' own schemas (the reference)."""
    for path in sorted(FIXTURES.rglob("*.jsonl")):
        task = path.parent.name if path.parent.parent == FIXTURES else "mmlu"
        assert check_rows(task, path) >= 1, path


def _edit(folder: Path, relative: str, line: int, change) -> Path:
    path = folder / relative
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows[line - 1] = change(rows[line - 1])
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


CASES = {
    "mmlu answer as a string": (
        "mmlu/philosophy/test.jsonl",
        2,
        lambda r: {**r, "answer": str(r["answer"])},
        "field 'answer' must be the integer 0, 1, 2 or 3 (a number, not a string)",
    ),
    "mmlu three choices": (
        "mmlu/philosophy/test.jsonl",
        1,
        lambda r: {**r, "choices": r["choices"][:3]},
        "4 strings",
    ),
    "arc answerKey not a label": ("arc_easy/test.jsonl", 1, lambda r: {**r, "answerKey": "E"}, "'answerKey'"),
    "arc choices as a list": ("arc_easy/test.jsonl", 2, lambda r: {**r, "choices": ["a", "b"]}, "'choices'"),
    "hellaswag label out of range": (
        "hellaswag/validation.jsonl",
        1,
        lambda r: {**r, "label": "7"},
        "'label'",
    ),
    "hellaswag ctx_b missing": (
        "hellaswag/validation.jsonl",
        2,
        lambda r: {k: v for k, v in r.items() if k != "ctx_b"},
        "'ctx_b' must be a string",
    ),
    "a row that is a list": ("arc_easy/test.jsonl", 1, lambda r: [r], "the row is a JSON list"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_row_is_named_by_file_and_line_before_any_model_loads(case, tmp_path, monkeypatch, capsys):
    relative, line, change, message = CASES[case]
    data = tmp_path / "data"
    shutil.copytree(FIXTURES, data)
    path = _edit(data, relative, line, change)
    task = relative.split("/")[0]
    shots = {"mmlu": 0} if task == "mmlu" else {task: 0}
    subjects = ["philosophy"] if task == "mmlu" else None
    with pytest.raises(SchemaError) as caught:
        plan_tasks(shots, data, subjects)
    assert f"{path}:{line}: " in str(caught.value) and message in str(caught.value)

    import lm_eval

    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda *a, **k: pytest.fail("evaluated bad data"))
    unused = tmp_path / "unused"  # a checkpoint folder as far as the path check goes; never loaded
    unused.mkdir()
    (unused / "config.json").write_text("{}")
    argv = ["lm-eval", "--tasks", task, "--data-dir", str(data), "--pretrained", str(unused)]
    if subjects:
        argv += ["--mmlu-subjects", *subjects]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}: " in err and "Traceback" not in err
