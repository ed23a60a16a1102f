"""scripts/cpu_constant_ab.py: the A/B of a tuning constant runs every value, reports each, and
leaves the constant as it found it; a name the module lacks is one line, before any work."""

from __future__ import annotations

import torch
from scripts_by_path import load_script

from hf_posenc.encodings import network_block


def _script():
    return load_script("cpu_constant_ab")


def test_every_value_is_timed_and_the_constant_restored(capsys):
    before = network_block.NETWORK_CHUNK
    code = _script().main(
        [
            "--encoding", "fire", "--mode", "train", "--length", "64", "--rounds", "2",
            "--constant", "hf_posenc.encodings.network_block:NETWORK_CHUNK", "--values", "128", "4096",
        ]
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["NETWORK_CHUNK=128", "NETWORK_CHUNK=4096"]
    assert all(line.count(",") == 1 for line in lines)  # two rounds each
    assert before == network_block.NETWORK_CHUNK


def test_an_unknown_constant_is_one_line(capsys):
    assert (
        _script().main(
            ["--encoding", "fire", "--constant", "hf_posenc.encodings.network_block:NOPE", "--values", "1"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--constant: hf_posenc.encodings.network_block has no attribute 'NOPE'"]


def test_an_unknown_module_is_one_line(capsys):
    assert _script().main(["--encoding", "fire", "--constant", "nonexistent.module:X", "--values", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--constant: no module 'nonexistent.module' (expected module:NAME)"]


def test_native_alongside_the_encoding_as_it_is(capsys):
    """``--native`` without ``--constant``: the unpatched model and the encoding each take every
    round, and the encoding's median is given against native's."""
    code = _script().main(
        ["--encoding", "t5", "--mode", "forward", "--length", "32", "--rounds", "2", "--native"]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["native", "as is"]
    assert all(line.count(",") == 1 for line in lines)  # two rounds each
    assert "x native)" in lines[1]


def test_a_constant_without_values_is_one_line(capsys):
    code = _script().main(
        ["--encoding", "fire", "--constant", "hf_posenc.encodings.network_block:NETWORK_CHUNK"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--constant and --values go together (neither: the encoding as it is)"]


def test_rounds_are_reported_per_state_of_the_machine(capsys, monkeypatch):
    """``--by-state``: each round's state (here given: fast, slow, fast) groups the rounds, and each
    group's median is of its own rounds' ratios to native's step."""
    script = _script()
    states = iter(["fast", "slow", "fast"])
    monkeypatch.setattr(script.split_product_probe, "state", lambda: next(states))
    code = script.main(
        ["--encoding", "t5", "--mode", "forward", "--length", "32", "--rounds", "3", "--native", "--by-state"]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "native",
        "as is",
        "fast state (2 of 3 rounds)",
        "slow state (1 of 3 rounds)",
    ]
    assert all(line.endswith("x native") for line in lines[2:])


def test_the_state_probe_times_three_products():
    """scripts/split_product_probe.py: the split, batched and one-thread products each take a
    positive time, and torch's thread count is left as it was."""
    probe = load_script("split_product_probe")
    threads = torch.get_num_threads()
    found = probe.probe()
    assert sorted(found) == ["batched", "one_thread", "split"]
    assert all(value > 0 for value in found.values())
    assert torch.get_num_threads() == threads
    assert probe.state() in ("fast", "slow")
    assert _script().split_product_probe.state() in ("fast", "slow")
