"""Which sequence-parallel engine serves which encoding (issue 22 item 3), and every refusal in one
line before a model loads.

The expectation table below is written from each encoding's published attention form, not read
from the code: context parallelism (torch's ring attention) is exact only where attention is plain
causal SDPA over per-token transformed q/k (rotations, absolute embeddings, ExPE's layer input,
nothing); a bias on the logits (T5, ALiBi, KERPLE, Sandwich, FIRE), an explicit score matrix
(CoPE, CAPE, stick-breaking, SelfExtend/ReRoPE's two position maps, dynamic NTK's per-query
frequencies) or state carried along the sequence (forget gates, TAPE's stream) are not. DeepSpeed
Ulysses goes through hf_posenc's head-parallel attention, which serves the encodings split by heads
(``tests/encoding_cases.HEAD_PARALLEL_SERVED``; its 2-process runs are in
tests/attention/test_head_parallel.py, and with DeepSpeed's engine below where DeepSpeed is
installed); ``hf-posenc train --sequence-parallel`` is tested in test_ulysses_training.py.
Context parallelism needs CUDA GPUs, which this machine lacks; the 2-process CPU runs of DDP/FSDP
are in test_training.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer
from hf_posenc.recipes.training import parallelism
from hf_posenc.recipes.training.parallelism import (
    engine_refusal,
    probe_encodings,
    request_forms,
    sequence_parallel_refusal,
)
from tests.encoding_cases import CASES_BY_ENCODING, head_parallel_serves

#: encoding -> True when its published attention is plain causal SDPA (context parallelism serves it)
PLAIN_SDPA: dict[str, bool] = {
    "nope": True,  # no positions at all (Kazemnejad et al. 2023)
    "sinusoidal": True,  # added to the embeddings (Vaswani et al. 2017)
    "learned": True,  # learned table added to the embeddings
    "rope": True,  # rotation of q and k (Su et al. 2021); see DYNAMIC below
    "xpos": True,  # rotation and per-token scaling of q and k (Sun et al. 2022)
    "liere": True,  # learned rotations of q and k (Ostmeier et al. 2024)
    "fope": True,  # Fourier rotations of q and k (Hua et al. 2024)
    "rope2d": True,  # axis rotations of q and k
    "comrope": True,  # commuting rotations of q and k (Yu et al. 2025)
    "expe": True,  # rewrites the layer input per token (ExPE)
    "exqpe": True,
    "t5": False,  # bucketed bias on the logits (Raffel et al. 2020)
    "alibi": False,  # linear bias on the logits (Press et al. 2022)
    "kerple": False,  # kernelised bias on the logits (Chi et al. 2022)
    "sandwich": False,  # bias on the logits (Chi et al. 2023)
    "fire": False,  # MLP of the distance on the logits (Li et al. 2024)
    "selfextend": False,  # two position maps chosen per (query, key) (Jin et al. 2024)
    "rerope": False,  # two position maps chosen per (query, key) (Su 2023)
    "leaky_rerope": False,
    "cope": False,  # positions counted from the scores themselves (Golovneva et al. 2024)
    "cape": False,  # MLP over the score matrix (Zheng et al. 2024)
    "sba": False,  # stick-breaking replaces the softmax (Tan et al. 2024)
    "fox": False,  # cumulative forget gates (Lin et al. 2025)
    "fox_pro": False,  # forget gates plus token shift
    "tape": False,  # a positional stream from layer to layer (Zhu et al. 2025)
}


def _dynamic(params: dict) -> bool:
    """Dynamic NTK and LongRoPE: frequencies depend on the current length, so q.k is computed per
    query (explicit logits), not as one rotation of q and k."""
    return (params.get("scaling") or {}).get("type") in ("dynamic", "longrope")


CASES = [case for cases in CASES_BY_ENCODING.values() for case in cases]


def test_the_table_covers_every_registered_encoding():
    """No encoding is left without an expectation (a new one must be added to the table)."""
    from hf_posenc.core.registry import encoding_names

    assert set(PLAIN_SDPA) == set(encoding_names())


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_context_parallel_serves_exactly_the_plain_sdpa_encodings(name, params):
    """Context parallelism is allowed for an encoding case iff its attention is plain causal SDPA."""
    expected = PLAIN_SDPA[name] and not _dynamic(params)
    refusal = engine_refusal("context_parallel", request_forms(name, params))
    assert (refusal is None) == expected, refusal
    if refusal:
        assert f"{name!r}" in refusal and "allowed:" in refusal and "\n" not in refusal


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_ulysses_serves_exactly_the_encodings_split_by_heads(name, params):
    refusal = sequence_parallel_refusal(probe_encodings(name, params))
    assert (refusal is None) == head_parallel_serves(name, params), refusal
    if refusal:
        assert f"{name!r}" in refusal and "allowed:" in refusal and "\n" not in refusal
    assert sequence_parallel_refusal([]) is None  # a native model


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"scaling": {"type": "ntk", "factor": 2.0}}, True),
        ({"scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}}, True),
        ({"scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}}, False),
    ],
)
def test_rope_scalings_beyond_the_shared_cases(params, allowed):
    """The README's claims on RoPE scalings: fixed schedules rotate, length-dependent ones do not."""
    assert (engine_refusal("context_parallel", request_forms("rope", params)) is None) == allowed


@pytest.mark.parametrize(
    ("pattern", "allowed"), [("rope*3+nope", True), ("rope*3+alibi", False), ("nope+fox", False)]
)
def test_a_hybrid_is_served_only_when_every_part_is(pattern, allowed):
    assert (engine_refusal("context_parallel", request_forms(pattern)) is None) == allowed


def test_the_config_files_parse_with_accelerates_loader():
    """recipes/accelerate/cp_fsdp2.yaml: FSDP2 with cp_size x dp_shard_size processes;
    ulysses.yaml: DeepSpeed (the degree comes from --sequence-parallel)."""
    from accelerate import ParallelismConfig
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    folder = Path(__file__).resolve().parents[2] / "recipes" / "accelerate"
    cp = load_config_from_file(str(folder / "cp_fsdp2.yaml"))
    assert cp.distributed_type == DistributedType.FSDP and cp.fsdp_config["fsdp_version"] == 2
    sizes = {k.removeprefix("parallelism_config_"): v for k, v in cp.parallelism_config.items()}
    assert sizes["cp_size"] > 1 and sizes["cp_size"] * sizes["dp_shard_size"] == cp.num_processes
    built = ParallelismConfig(cp_size=sizes["cp_size"], dp_shard_size=sizes["dp_shard_size"])
    assert built.total_size == cp.num_processes
    ulysses = load_config_from_file(str(folder / "ulysses.yaml"))
    # no parallelism_config section: accelerate's launcher takes one with FSDP2 only
    assert ulysses.distributed_type == DistributedType.DEEPSPEED and not ulysses.parallelism_config


def test_parallelism_config_fills_the_remaining_processes():
    """cp over 8 processes with degree 2: weights sharded over the other 4; Ulysses: sp_size, deepspeed."""
    built = parallelism.parallelism_config(2, 1, 8)
    assert (built.cp_size, built.dp_shard_size, built.total_size) == (2, 4, 8)
    ulysses = parallelism.parallelism_config(1, 4, 8)
    assert (ulysses.sp_size, ulysses.sp_backend, ulysses.data_parallel_size) == (4, "deepspeed", 2)
    assert parallelism.parallelism_config(1, 1, 8) is None


class _FakeCP:
    """An accelerator with context parallelism on: records what would be sharded."""

    class parallelism_config:  # noqa: N801
        cp_enabled = True

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
        import contextlib

        self.buffers = buffers
        assert buffer_seq_dims == [1] * len(buffers)
        return contextlib.nullcontext()


def test_shards_carry_true_positions_and_labels_shifted_before_sharding():
    """Each rank must see its tokens' own positions and next-token targets: positions explicit,
    target of token t = label t+1 (-100 at the end), as transformers shifts labels."""
    ids = torch.arange(12).reshape(2, 6)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    fake = _FakeCP()
    with parallelism.context_parallel_shards(fake, inputs):
        pass
    assert inputs["labels"] is inputs["shift_labels"]
    assert torch.equal(inputs["position_ids"], torch.tensor([[0, 1, 2, 3, 4, 5]] * 2))
    expected = torch.tensor([[1, 2, 3, 4, 5, -100], [7, 8, 9, 10, 11, -100]])
    assert torch.equal(inputs["shift_labels"], expected)
    assert len(fake.buffers) == 3


def test_shifted_labels_give_the_loss_of_labels():
    """transformers' causal-LM loss takes pre-shifted labels: the same loss as ``labels`` (one process)."""
    model = tiny_model("llama", vocab_size=50, max_positions=32)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    reference = model(**inputs).loss
    with parallelism.context_parallel_shards(_FakeCP(), inputs):
        pass
    assert torch.allclose(model(**inputs).loss, reference)


# -- refusals through the CLI: one line, exit 2, before any model loads ---------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seqpar")
    documents = list(stdlib_documents())[:6]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=300)
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "Loading weights" not in err, err
    return errors[0]


def _run(workspace: Path, tmp_path: Path, *extra: str) -> int:
    argv = ["train", "--model", str(workspace / "base"), "--output-dir", str(tmp_path / "run")]
    return main([*argv, "--seq-len", "32", "--max-steps", "1", *extra])


def _heads(workspace: Path) -> int:
    import json

    return json.loads((workspace / "base" / "config.json").read_text())["num_attention_heads"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--context-parallel", "2", "--encoding", "alibi"], ["'alibi'", "plain causal SDPA"]),
        (["--context-parallel", "2", "--encoding", "fox"], ["'fox'", "allowed:"]),
        (
            ["--context-parallel", "2", "--encoding", "rope", "--seq-len", "30"],
            ["--seq-len 30", "multiple of 4"],
        ),
        (["--context-parallel", "2", "--encoding", "rope", "--packing"], ["--packing", "across documents"]),
        (["--context-parallel", "2", "--encoding", "rope", "--loss", "chunked"], ["--loss chunked", "full"]),
        (["--sequence-parallel", "2", "--encoding", "cape"], ["'cape'", "mix or parametrise the heads"]),
        (["--sequence-parallel", "2", "--encoding", "alibi"], ["--sequence-parallel 2", "DeepSpeed"]),
        (["--sequence-parallel", "2", "--seq-len", "31"], ["--seq-len 31", "multiple of 2"]),
        (["--context-parallel", "2", "--sequence-parallel", "2"], ["one of them"]),
        (["--context-parallel", "0"], ["--context-parallel 0", ">= 1"]),
    ],
)
def test_a_setting_no_engine_can_run_is_one_line(workspace, tmp_path, capsys, extra, expected):
    assert _run(workspace, tmp_path, *extra) == 2
    line = _one_error(capsys)
    assert all(part in line for part in expected), line
    assert not (tmp_path / "run").exists()


def test_heads_not_divisible_by_the_ulysses_degree_are_named(workspace, tmp_path, capsys):
    heads = _heads(workspace)
    degree = next(d for d in range(2, 64) if heads % d)
    assert _run(workspace, tmp_path, "--sequence-parallel", str(degree), "--seq-len", str(degree * 8)) == 2
    line = _one_error(capsys)
    assert f"num_attention_heads={heads}" in line, line


def test_a_served_setting_names_what_this_machine_lacks(workspace, tmp_path, capsys):
    """rope with --context-parallel 2 passes the encoding checks and stops at the machine: no CUDA
    here (on a GPU machine, not launched with FSDP2); Ulysses stops at DeepSpeed (not installed, or
    not a DeepSpeed launch)."""
    assert _run(workspace, tmp_path, "--context-parallel", "2", "--encoding", "rope") == 2
    line = _one_error(capsys)
    assert ("needs CUDA" in line) if not torch.cuda.is_available() else ("FSDP2" in line), line
    assert _run(workspace, tmp_path, "--sequence-parallel", "2") == 2
    line = _one_error(capsys)
    assert "--sequence-parallel 2 needs" in line and "DeepSpeed" in line, line


def test_a_flag_contradicting_the_launch_config_is_named(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    assert _run(workspace, tmp_path, "--context-parallel", "4", "--encoding", "rope") == 2
    line = _one_error(capsys)
    assert "--context-parallel 4" in line and "PARALLELISM_CONFIG_CP_SIZE=2" in line, line
    # the launch config's degree alone is checked as if given as the flag
    assert _run(workspace, tmp_path, "--encoding", "t5") == 2
    assert "'t5'" in _one_error(capsys)


def test_the_loaded_model_is_asked_again():
    """After loading, the patched model's own encodings answer (every part of a hybrid; a native
    model has none to refuse)."""
    import hf_posenc

    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    hf_posenc.patch_model(model, "+".join(["rope"] * (layers - 1) + ["alibi"]))
    assert "'alibi'" in engine_refusal("context_parallel", parallelism.model_forms(model))
    dynamic = tiny_model("llama")
    hf_posenc.patch_model(dynamic, "rope", scaling={"type": "dynamic", "factor": 2.0})
    assert engine_refusal("context_parallel", parallelism.model_forms(dynamic)) is not None
    assert parallelism.model_forms(tiny_model("llama")) == {}


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["alibi", "fox", "fire"])
def test_deepspeed_ulysses_on_two_cpu_processes_equals_one_process(tmp_path, encoding):
    """DeepSpeed's own engine (accelerate's ParallelismConfig, its sequence-parallel groups, data
    adapter and gradient all-reduce) with head-parallel attention over its group: the loss and every
    gradient of a 2-rank step equal the one-process step. Needs DeepSpeed (not a project dependency:
    CI and this machine's environment lack it; run it where ``DS_BUILD_OPS=0 pip install
    --no-build-isolation deepspeed`` installed it)."""
    import json

    from conftest import run_two_processes

    pytest.importorskip("deepspeed")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out.json"
    run_two_processes(
        root / "recipes/train/ulysses_check.py", encoding, str(out), ACCELERATE_USE_DEEPSPEED="true"
    )
    report = json.loads(out.read_text())
    parallel, single = report["loss"]
    assert abs(parallel - single) <= 1e-5 * abs(single)
    assert report["errors"] and all(
        error is not None and error <= 1e-5 for error in report["errors"].values()
    )
