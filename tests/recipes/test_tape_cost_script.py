"""scripts/tape_value_width_cost.py: every case of one layer is timed and reported, per state
of the machine with ``--by-state``, and torch's thread count is left as it was."""

from __future__ import annotations

import torch
from scripts_by_path import load_script

CASES = [
    "native forward (width D)",
    "native backward (width D)",
    "fused forward, q/k padded to 2D",
    "fused backward, q/k padded to 2D",
    "blocked forward",
    "blocked backward, heads split",
    "blocked backward, ops threaded",
]


def _script():
    return load_script("tape_value_width_cost")


def test_every_case_is_reported_per_state(capsys, monkeypatch):
    script = _script()
    states = iter(["fast", "slow", "fast"])
    monkeypatch.setattr(script.split_product_probe, "state", lambda: next(states))
    threads = torch.get_num_threads()
    script.main(["--length", "64", "--heads", "2", "--head-dim", "8", "--rounds", "3", "--by-state"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one layer: 2 heads of 8, values 16 wide, T=64")
    assert lines[1] == "fast state (2 rounds), median ms:" and lines[9] == "slow state (1 rounds), median ms:"
    for block in (lines[2:9], lines[10:17]):
        assert [line.rsplit(" ", 1)[0].strip() for line in block] == CASES
        assert all(float(line.rsplit(" ", 1)[1]) >= 0 for line in block)  # ms, one decimal
    assert torch.get_num_threads() == threads
