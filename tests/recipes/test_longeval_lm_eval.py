"""The retrieval tasks as lm-eval tasks (``hf-posenc lm-eval --tasks passkey_300 ...``): one task per
task and length in the group ``longeval``, generated for the model's tokenizer, run offline through
lm-eval's ``generate_until`` with the hf-posenc model; lm-eval's generations and scores equal what
``hf-posenc longeval`` generates and scores for the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from longeval_reference import bpe_tokenizer

from hf_posenc.recipes.cli import main
from hf_posenc.recipes.longeval.tasks import TASKS
from hf_posenc.recipes.tiny import tiny_model

pytest.importorskip("lm_eval")

from hf_posenc.recipes.integrations.lm_eval_longeval import parse_task_name  # noqa: E402


def test_task_names_are_task_and_length():
    assert parse_task_name("passkey_4096") == (TASKS["passkey"], 4096)
    assert parse_task_name("niah_multikey_2_2048") == (TASKS["niah_multikey_2"], 2048)
    assert parse_task_name("niah_multikey_2") is None  # a RULER task name without a length
    assert parse_task_name("hellaswag") is None
    assert parse_task_name("passkey_0") is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("longeval-lm-eval") / "llama"
    tokenizer = bpe_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow  # lm-eval's import and two evaluations: multi-second
def test_lm_eval_generations_and_scores_equal_the_command_line(checkpoint, tmp_path, capsys):
    settings = ["--samples", "2", "--depths", "0", "1"]
    tasks = ["passkey_300", "vt_300"]
    argv = ["lm-eval", "--tasks", *tasks, "--pretrained", str(checkpoint), *settings, "--device", "cpu"]
    assert main([*argv, "--batch_size", "1", "--output", str(tmp_path / "lm"), "--log_samples"]) == 0
    table = capsys.readouterr().out
    assert "longeval" in table and "passkey_300" in table
    written = next((tmp_path / "lm").rglob("results_*.json"))
    lm_results = json.loads(written.read_text())["results"]
    generations = {}
    for path in (tmp_path / "lm").rglob("samples_*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            generations[row["doc"]["prompt"]] = (row["filtered_resps"][0], row["score"])
    assert len(generations) == 2 * 2 + 2  # passkey: 2 depths x 2 samples; vt ignores depth

    # the same prompts through hf-posenc's runner (what `hf-posenc longeval` runs)
    from transformers import AutoTokenizer

    from hf_posenc.core.loading import load_model
    from hf_posenc.recipes.longeval.runner import evaluate_samples
    from hf_posenc.recipes.longeval.tasks import task_samples

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    samples = [
        s
        for t, n in (("passkey", 300), ("vt", 300))
        for s in task_samples(TASKS[t], tokenizer, n, [0.0, 1.0], 2, 0)
    ]
    ours = evaluate_samples(load_model(str(checkpoint)), tokenizer, samples)
    assert {r.sample.prompt: (r.output, r.score) for r in ours} == generations

    out = tmp_path / "cli"
    cli = ["longeval", "--model", str(checkpoint), "--tasks", "passkey", "vt", "--lengths", "300"]
    assert main([*cli, *settings, "--output-dir", str(out), "--no-progress"]) == 0
    cells = next(iter(json.loads((out / "results.json").read_text())["results"].values()))
    overall = {f"{c['task']}_{c['length']}": c["accuracy"] for c in cells if c["depth"] is None}
    for task in tasks:
        assert lm_results[task]["score,none"] == pytest.approx(overall[task])
