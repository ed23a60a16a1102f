"""The max-length benchmark (``python -m hf_posenc.recipes.benchmark.max_length``): the search
finds the longest length within the budget, and a real trial measures one training step."""

from __future__ import annotations

import argparse

import pytest

from hf_posenc.recipes.benchmark import max_length


def settings(**overrides) -> argparse.Namespace:
    args = max_length.parser().parse_args(["--memory-gb", "1", "--start", "100", "--limit", "1000000000"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(("fixed", "per_token", "resolution"), [(1e6, 3000.0, 0.05), (5e8, 10.0, 0.01)])
def test_the_search_finds_the_longest_length_within_the_budget(monkeypatch, fixed, per_token, resolution):
    """With peak(T) = fixed + per_token * T, the longest fitting T is within --resolution of
    (budget - fixed) / per_token, never above it; the reported slope is per_token."""
    args = settings(resolution=resolution)
    budget = args.memory_gb * 2**30

    def peak(args, name, length):
        value = int(fixed + per_token * length)
        return value if value <= budget else None

    monkeypatch.setattr(max_length, "trial", peak)
    row = max_length.longest(args, "alibi")
    exact = (budget - fixed) / per_token
    assert exact * (1 - resolution) <= row["max_length"] <= exact
    assert row["bytes_per_token"] == pytest.approx(per_token, rel=1e-3)
    assert not row["capped"]


def test_a_row_still_fitting_at_the_limit_is_marked_capped(monkeypatch):
    monkeypatch.setattr(max_length, "trial", lambda args, name, length: 1000)
    row = max_length.longest(settings(limit=800), "native")
    assert row["max_length"] == 800 and row["capped"]
    assert "800+" in max_length.table([row])


@pytest.mark.slow  # two trial subprocesses (imports torch and transformers); CI runs it
def test_a_cpu_trial_measures_one_training_step_and_misses_past_the_budget():
    tiny = dict(vocab_size=4096, hidden_size=32, num_layers=1, num_heads=2, loss="full")
    args = settings(memory_gb=0.05, **tiny)
    args.forwarded = max_length._model_flags(args)
    peak = max_length.trial(args, "alibi", 256)
    assert peak is not None and 0 < peak <= 0.05 * 2**30
    assert max_length.trial(args, "alibi", 8192) is None  # its (T x vocabulary) fp32 logits alone are 128 MiB


def test_a_bad_budget_is_refused(capsys):
    with pytest.raises(SystemExit):
        max_length.main(["--memory-gb", "0"])
    assert "--memory-gb > 0" in capsys.readouterr().err
