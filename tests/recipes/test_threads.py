"""The recipes' torch thread count (issue 24): --threads wins, then OMP_NUM_THREADS, then one
thread for a small model or a busy machine, else torch's default; the reason is recorded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hf_posenc.errors import PosencError
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.threads import choose_threads

IDLE = {"environ": {}, "cores": 8, "default_threads": 8, "load_average": 0.5}


@given(requested=st.integers(1, 64), parameters=st.one_of(st.none(), st.integers(0, 10**10)))
def test_the_flag_wins_over_everything(requested, parameters):
    choice = choose_threads(requested, parameters, **{**IDLE, "environ": {"OMP_NUM_THREADS": "3"}})
    assert (choice.threads, choice.reason) == (requested, "--threads")


@given(omp=st.integers(1, 64), parameters=st.one_of(st.none(), st.integers(0, 10**10)))
def test_omp_num_threads_wins_over_the_rule(omp, parameters):
    choice = choose_threads(None, parameters, **{**IDLE, "environ": {"OMP_NUM_THREADS": str(omp)}})
    assert choice.threads == omp and "OMP_NUM_THREADS" in choice.reason


@given(parameters=st.one_of(st.none(), st.integers(0, 10**10)), load=st.floats(8, 100))
def test_any_model_on_a_busy_machine_gets_one_thread(parameters, load):
    """Measured: under load one thread trained the study's model 5.5x faster than two."""
    choice = choose_threads(None, parameters, **{**IDLE, "load_average": load})
    assert choice.threads == 1 and "busy" in choice.reason


@given(parameters=st.one_of(st.none(), st.integers(0, 10**10)), load=st.floats(0, 7.99))
def test_any_model_on_a_quiet_machine_gets_torchs_default(parameters, load):
    """Measured: idle, two threads trained the study's (1.2 M parameter) model 1.78x faster than one."""
    choice = choose_threads(None, parameters, **{**IDLE, "load_average": load})
    assert choice.threads == 8 and "default" in choice.reason


@pytest.mark.parametrize("bad", [0, -2])
def test_a_bad_thread_count_is_refused(bad):
    with pytest.raises(PosencError, match="allowed: an integer >= 1"):
        choose_threads(bad, None, **IDLE)


@pytest.mark.parametrize("command", [["train", "--model", "m", "--output-dir", "o"], ["study"]])
def test_a_bad_threads_flag_is_one_line_before_anything_loads(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--threads", "0", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "threads" in err and "allowed: an integer >= 1" in err, err


@pytest.mark.slow  # a 1-step training run, several seconds
def test_a_training_run_uses_and_records_the_chosen_threads(tmp_path, monkeypatch):
    """Without --threads or OMP_NUM_THREADS, on a busy machine a run trains on one thread and its
    training_run.json says so and why."""
    import json

    import torch

    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tiny import tiny_model
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer
    from hf_posenc.recipes.training import TrainConfig, train

    documents = list(stdlib_documents())[:3]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=300)
    (tmp_path / "data.txt").write_text("\n\n".join(documents))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("hf_posenc.recipes.threads._first_load_average", lambda: 1000.0)  # busy
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        config = TrainConfig(
            model="tiny",
            output_dir=str(tmp_path / "run"),
            data=[str(tmp_path / "data.txt")],
            seq_len=16,
            batch_size=2,
            max_steps=1,
        )
        model = tiny_model("llama", vocab_size=len(tokenizer), max_positions=32)
        result = train(config, model=model, tokenizer=tokenizer, progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    record = json.loads((result.final_dir / "training_run.json").read_text())["provenance"]["threads"]
    assert record["threads"] == 1 and "busy" in record["reason"]
