"""LongLoRA in ``hf-posenc train`` (issue 23): ``--s2-attn`` (shifted sparse attention in training
forwards only) with ``--lora --lora-trainable embed,norm`` (embeddings and norms trained fully
through peft's ``modules_to_save``). Bad settings end in one line before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from training_runs import one_error, train_argv

import hf_posenc
from hf_posenc.attention import forward
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.data import stdlib_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A saved tiny Llama and a tiny GPT-2 (tied ``wte``) with one tokenizer, and a small data file."""
    root = tmp_path_factory.mktemp("longlora")
    documents = list(stdlib_documents())[:10]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=400)
    for family, overrides in (("llama", {}), ("gpt2", {}), ("mistral", {"sliding_window": 16})):
        tiny_model(family, vocab_size=len(tokenizer), max_positions=64, **overrides).save_pretrained(
            root / family
        )
        tokenizer.save_pretrained(root / family)
    (root / "data.txt").write_text("\n\n".join(documents[:6]))
    return root


def run(workspace: Path, tmp_path: Path, *extra: str, family: str = "llama") -> int:
    return main(train_argv(workspace, family, tmp_path / "run", *extra))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--encoding", "rope", "--s2-attn", "--seq-len", "36"), "(9 tokens) does not cut a sequence of 36"),
        (("--encoding", "rope", "--s2-attn", "--s2-group-size", "5"), "group size 5 is not allowed"),
        (("--encoding", "rope", "--s2-attn", "--s2-group-size", "12"), "group size 12 does not cut"),
        (("--encoding", "rope", "--s2-attn", "--s2-group-size", "2/1"), "group size '2/1' is not allowed"),
        (("--encoding", "rope", "--s2-group-size", "8"), "without s2_attn would be ignored"),
        (("--encoding", "alibi", "--s2-attn"), "cannot wrap encoding 'alibi'"),
        (("--encoding", "rope*1+t5", "--s2-attn"), "cannot wrap encoding 't5'"),
        (("--s2-attn",), "needs an hf_posenc encoding"),
        (("--encoding", "rope", "--s2-attn", "--s2-wrap", "--packing"), "--s2-wrap with --packing"),
        (("--lora-trainable", "embed"), "without lora would be ignored"),
        (("--lora", "--lora-trainable", "embed,bias"), "allowed: any of embed, norm"),
    ],
)
def test_bad_longlora_settings_are_one_line_before_loading(workspace, tmp_path, capsys, extra, message):
    assert run(workspace, tmp_path, *extra) == 2
    line = one_error(capsys)
    assert message in line, line
    assert not (tmp_path / "run").exists()


def test_a_tied_embedding_peft_cannot_keep_tied_is_refused_before_loading(workspace, tmp_path, capsys):
    """GPT-2 ties ``wte`` to its output layer; peft ties a trained copy only for ``embed_tokens``."""
    assert run(workspace, tmp_path, "--lora", "--lora-trainable", "embed", family="gpt2") == 2
    line = one_error(capsys)
    assert "'transformer.wte' is tied" in line and "--lora-trainable norm" in line, line


def test_rolled_groups_on_a_sliding_window_checkpoint_are_refused_before_loading(workspace, tmp_path, capsys):
    """A sliding window is an attention mask, which --s2-wrap's rolled groups cannot follow."""
    assert run(workspace, tmp_path, "--encoding", "rope", "--s2-attn", "--s2-wrap", family="mistral") == 2
    line = one_error(capsys)
    assert "--s2-wrap is not allowed" in line and "sliding window" in line, line


def test_s2_settings_reach_the_dry_run(workspace, tmp_path, capsys):
    """A ratio given as text is kept as a number; the settings file takes it back."""
    code = run(workspace, tmp_path, "--encoding", "rope", "--s2-attn", "--s2-group-size", "1/4", "--dry-run")
    assert code == 0
    settings = json.loads(capsys.readouterr().out)
    assert settings["s2_attn"] is True and settings["s2_group_size"] == 0.25 and settings["s2_wrap"] is False


@pytest.mark.slow  # a few seconds: a real (tiny) training run
def test_longlora_run_trains_in_shifted_groups_and_saves_a_full_attention_model(
    workspace, tmp_path, capsys, monkeypatch
):
    """``train --encoding rope --s2-attn --lora --lora-trainable embed,norm`` on the built-in corpus:
    every training forward of every layer goes through S2-Attn (and none other), the run ends with
    a model whose embeddings and norms changed, with no peft wrapper left and nothing of S2 saved,
    which reloads and attends in full."""
    calls = []
    real = forward.shifted_sparse_attention

    def spy(call, settings):
        calls.append((call.q.shape[-2], settings.group(call.q.shape[-2])))
        return real(call, settings)

    monkeypatch.setattr(forward, "shifted_sparse_attention", spy)
    argv = ["train", "--model", str(workspace / "llama"), "--output-dir", str(tmp_path / "run")]
    argv += ["--max-documents", "20", "--seq-len", "32", "--batch-size", "2", "--max-steps", "3"]
    argv += ["--encoding", "rope", "--s2-attn", "--lora", "--lora-trainable", "embed,norm", "--lr", "1e-2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert calls and set(calls) == {(32, 8)}  # the default group: a quarter of --seq-len
    assert len(calls) == 3 * 2  # 3 steps x 2 layers
    final = tmp_path / "run" / "final"
    config = json.loads((final / "config.json").read_text())
    assert "s2" not in json.dumps(config["posenc"])
    trained = hf_posenc.from_pretrained(str(final))
    base = _weights(workspace / "llama")
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert not torch.equal(trained.state_dict()[name], base[name]), name
    assert not any("modules_to_save" in n or "lora_" in n for n in trained.state_dict())
    assert json.loads((tmp_path / "run" / "final" / "losses.json").read_text())
    calls.clear()
    hf_posenc.enable_s2_attn(trained)
    trained.eval()
    with torch.no_grad():
        trained(torch.randint(0, trained.config.vocab_size, (1, 32)))
    assert calls == []  # inference: full attention


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_the_s2_benchmark_pairs_full_and_s2_steps(tmp_path):
    """The speed benchmark runs both modes at every length and writes one row per (length, mode)."""
    from hf_posenc.recipes.benchmark import s2_attn

    out = tmp_path / "s2.json"
    argv = ["--lengths", "32", "64", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2"]
    assert s2_attn.main([*argv, "--vocab-size", "64", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["length"], r["mode"]) for r in rows] == [(32, "full"), (32, "s2"), (64, "full"), (64, "s2")]
    assert all(r["median_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    with pytest.raises(hf_posenc.InvalidParameterError, match="sequence of 30 tokens"):
        s2_attn.main(["--lengths", "30"])
