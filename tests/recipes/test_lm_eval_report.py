"""lm-eval's comparison table says what its numbers are: value ± standard error and the number
of examples scored, per model; a group's count is the sum over its subtasks."""

from __future__ import annotations

from hf_posenc.recipes.integrations.lm_eval_report import comparison_rows, sample_count


def _results(acc: float, stderr: float, arc_n: int) -> dict:
    """lm-eval's results dict in its own schema (lm_eval/result_schema.py), two tasks and a group."""
    return {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": acc, "acc_stderr,none": stderr},
            "mmlu": {"alias": "mmlu", "acc,none": 0.25, "acc_stderr,none": 0.01},
            "mmlu_anatomy": {"alias": " - anatomy", "acc,none": 0.2, "acc_stderr,none": 0.02},
        },
        "group_subtasks": {"mmlu": ["mmlu_anatomy", "mmlu_astronomy"], "arc_easy": []},
        "n-samples": {
            "arc_easy": {"original": 2376, "effective": arc_n},
            "mmlu_anatomy": {"original": 135, "effective": 10},
            "mmlu_astronomy": {"original": 152, "effective": 10},
        },
    }


def test_sample_counts_come_from_n_samples_and_groups_sum_their_subtasks():
    results = _results(0.5, 0.05, 20)
    assert sample_count(results, "arc_easy") == 20
    assert sample_count(results, "mmlu") == 20
    assert sample_count(results, "hellaswag") is None


def test_one_model_has_value_stderr_and_n_columns():
    headers, rows = comparison_rows([("a", _results(0.5, 0.05, 20))], {"arc_easy": 25, "mmlu": 5})
    assert headers == ["task", "n-shot", "metric", "value", "± stderr", "n"]
    assert rows == [
        ["arc_easy", "25", "acc", "0.5000", "0.0500", "20"],
        ["mmlu", "5", "acc", "0.2500", "0.0100", "20"],
    ]


def test_several_models_get_value_plus_minus_stderr_and_n_in_each_cell():
    runs = [("rope", _results(0.5, 0.05, 20)), ("alibi", _results(0.625, 0.0625, 16))]
    headers, rows = comparison_rows(runs, {"arc_easy": 0})
    assert headers[3:] == ["rope: value ± stderr (n)", "alibi: value ± stderr (n)"]
    assert rows == [["arc_easy", "0", "acc", "0.5000 ± 0.0500 (n=20)", "0.6250 ± 0.0625 (n=16)"]]
