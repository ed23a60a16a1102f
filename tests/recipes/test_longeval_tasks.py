"""Long-context retrieval tasks (passkey, RULER's synthetic tasks): prompts of exactly the requested
number of tokens for several tokenizers, the same prompts for one seed, answers that a reference
solver written from the task definitions finds in the prompt, and scoring that gives an
answer-copying model 100% and a wrong-number model 0%."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from longeval_reference import char_level_tokenizer, longeval_tokenizers, oracle_lm, solve, wrong_lm

from hf_posenc.recipes.evaluation.errors import EvaluationError
from hf_posenc.recipes.longeval.fit import PromptLengthError
from hf_posenc.recipes.longeval.runner import evaluate_samples, summarize
from hf_posenc.recipes.longeval.scoring import score
from hf_posenc.recipes.longeval.tasks import (
    TASKS,
    check_depths,
    check_samples,
    check_tasks,
    check_tokenizer,
    minimum_length,
    task_samples,
)

DEPTHS = [0.0, 0.5, 1.0]


@pytest.fixture(scope="module", name="longeval_tokenizers")
def _tokenizers():
    return longeval_tokenizers()


def _length_for(task, tokenizer, extra: int, seed: int = 0, samples: int = 3) -> int:
    return minimum_length(TASKS[task], tokenizer, 2048, samples=samples, seed=seed) + extra


@pytest.mark.parametrize("kind", ["bpe", "byte", "char"])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompts_have_exactly_the_requested_length(longeval_tokenizers, kind, task):
    """Every prompt is exactly ``length`` tokens as the tokenizer counts them (BOS included), at two
    lengths above the task's minimum, for a trained BPE, a byte-level and a character-level tokenizer."""
    tokenizer = longeval_tokenizers[kind]
    for extra in (3, 211):
        length = min(
            _length_for(task, tokenizer, extra, seed=5), 4095
        )  # one setting (RULER switches cwe at 4096)
        for sample in task_samples(TASKS[task], tokenizer, length, DEPTHS, 2, seed=5):
            assert len(tokenizer(sample.prompt)["input_ids"]) == length == sample.tokens


@pytest.mark.parametrize("task", list(TASKS))
def test_the_prompt_holds_the_answers_the_task_defines(longeval_tokenizers, task):
    """A reference solver written from the task definition reads the sample's answers from its text."""
    tokenizer = longeval_tokenizers["bpe"]
    length = _length_for(task, tokenizer, 150, seed=1)
    for sample in task_samples(TASKS[task], tokenizer, length, DEPTHS, 2, seed=1):
        assert sorted(solve(sample.prompt)) == sorted(sample.answers)


def test_same_seed_same_prompts_other_seed_other_prompts(longeval_tokenizers):
    tokenizer = longeval_tokenizers["bpe"]
    for task in TASKS.values():
        length = max(_length_for(task.name, tokenizer, 40, seed=s) for s in (3, 4))
        first = [s.prompt for s in task_samples(task, tokenizer, length, DEPTHS, 2, seed=3)]
        again = [s.prompt for s in task_samples(task, tokenizer, length, DEPTHS, 2, seed=3)]
        other = [s.prompt for s in task_samples(task, tokenizer, length, DEPTHS, 2, seed=4)]
        assert first == again
        assert first != other


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multivalue", "vt"])
def test_a_sample_keeps_its_key_at_every_length(longeval_tokenizers, task):
    """Sample i asks for the same key at every length and depth, so a row differs only in length."""
    tokenizer = longeval_tokenizers["bpe"]
    low = _length_for(task, tokenizer, 10)
    answers = {
        (length, depth): [s.answers for s in task_samples(TASKS[task], tokenizer, length, [depth], 3, seed=0)]
        for length in (low, low + 300)
        for depth in (0.0, 1.0)
    }
    assert len({tuple(a) for a in answers.values()}) == 1


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_passkey_follows_the_landmark_protocol(longeval_tokenizers, depth):
    """Landmark Attention's prompt: the instruction, int(depth * n) filler characters, the key line,
    the rest of the n filler characters, the question; the key in [1, 50000]."""
    tokenizer = longeval_tokenizers["char"]
    garbage = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    for sample in task_samples(TASKS["passkey"], tokenizer, 700, [depth], 3, seed=2):
        key = int(sample.answers[0])
        assert 1 <= key <= 50000
        lines = sample.prompt.split("\n")
        assert lines[0].startswith("There is an important info hidden inside a lot of irrelevant text.")
        assert lines[2] == f"The pass key is {key}. Remember it. {key} is the pass key."
        assert lines[4] == "What is the pass key? The pass key is"
        filler = " ".join([garbage] * 20)
        prefix, suffix = lines[1], lines[3]
        assert filler.startswith(prefix) and filler.startswith(suffix)
        assert len(prefix) == int((len(prefix) + len(suffix)) * depth)


def test_needle_depth_places_the_needle(longeval_tokenizers):
    """RULER single needle at depth d: the share of haystack lines before the needle is d."""
    tokenizer = longeval_tokenizers["bpe"]
    for depth in DEPTHS:
        sample = next(task_samples(TASKS["niah_single"], tokenizer, 1500, [depth], 1, seed=0))
        lines = sample.prompt.split("\n")[1:-1]  # the haystack with the needle
        where = next(i for i, line in enumerate(lines) if line.startswith("One of the special magic"))
        assert abs(where / (len(lines) - 1) - depth) <= 1 / (len(lines) - 1)


@pytest.mark.parametrize("task", list(TASKS))
def test_answer_copying_model_scores_100_and_wrong_numbers_0(longeval_tokenizers, task):
    tokenizer = longeval_tokenizers["bpe"]
    length = _length_for(task, tokenizer, 60)
    samples = list(task_samples(TASKS[task], tokenizer, length, DEPTHS, 2, seed=0))
    oracle = oracle_lm(tokenizer)
    right = summarize(evaluate_samples(oracle, tokenizer, samples, batch_size=3))
    assert {cell.accuracy for cell in right} == {1.0}
    assert set(oracle.prompt_lengths) == {length}
    bad = summarize(evaluate_samples(wrong_lm(tokenizer), tokenizer, samples, batch_size=2))
    assert {cell.accuracy for cell in bad} == {0.0}
    overall = [cell for cell in right if cell.depth is None]
    assert [cell.samples for cell in overall] == [len(samples)]


def test_scores_follow_the_source_definitions():
    """YaRN's passkey check (first integer), RULER's string_match_all (share found, case-insensitive)
    and string_match_part (any found), after RULER's postprocessing."""
    assert score("first_integer", " 4213. The pass key is 4213", ["4213"]) == 1.0
    assert score("first_integer", " 42130", ["4213"]) == 0.0
    assert score("first_integer", " the key is 12 and 4213", ["4213"]) == 0.0
    assert score("first_integer", " no number", ["4213"]) == 0.0
    assert score("all", " Apple, pear\x00and FIG", ["apple", "fig", "plum", "kiwi"]) == 0.5
    assert score("part", " Apple, pear", ["plum", "apple"]) == 1.0
    assert score("part", " pear", ["plum", "apple"]) == 0.0


@settings(max_examples=12, deadline=None)
@given(extra=st.integers(min_value=0, max_value=400), seed=st.integers(min_value=0, max_value=10**6))
def test_passkey_length_is_exact_for_any_length_and_seed(longeval_tokenizers, extra, seed):
    tokenizer = longeval_tokenizers["bpe"]
    length = minimum_length(TASKS["passkey"], tokenizer, 512, seed=seed) + extra
    sample = next(task_samples(TASKS["passkey"], tokenizer, length, [0.3], 1, seed=seed))
    assert len(tokenizer(sample.prompt)["input_ids"]) == length


def test_bad_requests_are_one_line_errors(longeval_tokenizers):
    with pytest.raises(EvaluationError, match=r"unknown task 'paskey'\. Did you mean 'passkey'\?"):
        check_tasks(["paskey"])
    with pytest.raises(EvaluationError, match=r"depth 1\.5 is not allowed; allowed: fractions in \[0, 1\]"):
        check_depths([0.5, 1.5])
    with pytest.raises(EvaluationError, match="--samples 0 is not allowed"):
        check_samples(0)
    no_digits = char_level_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,?:\n")
    with pytest.raises(EvaluationError, match="cannot express passkey's answers"):
        check_tokenizer(TASKS["passkey"], no_digits, "model 'm'")
    check_tokenizer(TASKS["passkey"], longeval_tokenizers["char"], "model 'm'")
    tokenizer = longeval_tokenizers["bpe"]
    shortest = minimum_length(TASKS["passkey"], tokenizer, 64)
    with pytest.raises(PromptLengthError, match=f"shorter than the task's minimum of {shortest} tokens"):
        next(task_samples(TASKS["passkey"], tokenizer, shortest - 1, [0.5], 1, seed=0))


@pytest.mark.parametrize("task", ["passkey", "niah_single", "vt"])
def test_training_documents_end_with_their_answer_at_the_training_length(longeval_tokenizers, task):
    """A training document is a prompt whose answer (by the reference solver) follows it, within a token
    of the requested length, with keys apart from the evaluation's for the same seed."""
    from hf_posenc.recipes.longeval.training_data import training_documents

    tokenizer = longeval_tokenizers["bpe"]
    length = _length_for(task, tokenizer, 80)
    documents = list(training_documents(TASKS[task], tokenizer, length, 4, seed=0))
    evaluation = {s.answers for s in task_samples(TASKS[task], tokenizer, length, [0.5], 4, seed=0)}
    for document in documents:
        assert abs(len(tokenizer(document)["input_ids"]) - length) <= 1
        answers = solve(document)
        assert document.rstrip(".").endswith(", ".join(answers)) or document.rstrip(".").endswith(answers[0])
        assert tuple(answers) not in evaluation


def test_heatmap_grid_draws_one_panel_per_model(tmp_path):
    from hf_posenc.recipes.longeval.report import plot_heatmap_grid
    from hf_posenc.recipes.longeval.runner import Cell

    results = {
        name: [Cell("passkey", n, d, 1.0 if n <= 128 else 0.5, 2, n) for n in (128, 256) for d in (0.0, 1.0)]
        for name in ("rope", "alibi", "nope")
    }
    path = plot_heatmap_grid(tmp_path / "grid.png", results, "passkey", 128, "study")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="no depth results of 'vt'"):
        plot_heatmap_grid(tmp_path / "none.png", results, "vt", 128, "study")
