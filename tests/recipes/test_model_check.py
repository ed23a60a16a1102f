"""The benchmarks' model flags are checked before any model is built: a shape the family cannot
build, a native model that cannot rotate its head width, or an encoding that cannot patch the
model is one line naming the flags; a shape that does work passes (the check is no stricter than
the models themselves)."""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc.errors import PosencError
from hf_posenc.recipes.benchmark import max_length, peak_memory, s2_attn, saved_memory
from hf_posenc.recipes.benchmark.model_check import check_model_flags
from hf_posenc.recipes.tiny import tiny_model

SHAPE = {"vocab_size": 16, "num_layers": 1, "max_positions": 32}


@pytest.mark.parametrize(
    ("family", "encodings", "shape", "message"),
    [
        ("llama", [], {"hidden_size": 0, "num_heads": 4}, "--hidden-size 0 is not allowed; allowed: >= 1"),
        (
            "llama",
            [],
            {"hidden_size": 32, "num_heads": 4, "vocab_size": -5},
            "--vocab-size -5 is not allowed",
        ),
        (
            "llama",
            [],
            {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 3},
            "--num-kv-heads 3 is not allowed with --num-heads 4; allowed: a divisor of 4",
        ),
        (
            "llama",
            [],
            {"hidden_size": 30, "num_heads": 4},
            "not a multiple of the number of attention heads (4)",
        ),
        ("llama", [], {"hidden_size": 20, "num_heads": 4}, "RoPE requires an even rotary dimension"),
        ("gpt2", [], {"hidden_size": 30, "num_heads": 4}, "`embed_dim` must be divisible by num_heads"),
        # transformers builds this one (head width 7), but its rotation of odd widths fails at run time
        ("qwen2", [], {"hidden_size": 28, "num_heads": 4}, "the native model's rotary dimension"),
        ("gpt2", ["alibi", "rope"], {"hidden_size": 20, "num_heads": 4}, "rope: rotary dimension"),
        ("gtp2", [], {"hidden_size": 32, "num_heads": 4}, "Did you mean 'gpt2'"),
    ],
)
def test_a_model_the_flags_cannot_give_is_one_line(family, encodings, shape, message):
    with pytest.raises(PosencError) as raised:
        check_model_flags(family, encodings, **{**SHAPE, **shape})
    text = str(raised.value)
    assert message in text and "\n" not in text, text


def test_a_model_the_flags_can_give_passes_and_runs():
    """GPT-2 with heads 5 wide: its own positions are a table and ALiBi rotates nothing, so the
    check lets it through, and the patched model does run."""
    check_model_flags("gpt2", ["alibi"], hidden_size=20, num_heads=4, **SHAPE)
    model = hf_posenc.patch_model(tiny_model("gpt2", hidden_size=20, num_heads=4, vocab_size=16), "alibi")
    logits = model(torch.randint(0, 16, (1, 8))).logits
    assert logits.shape == (1, 8, 16) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        (saved_memory, ["--hidden-size", "30"], "not a multiple of the number of attention heads"),
        (peak_memory, ["--num-heads", "0"], "--num-heads 0 is not allowed"),
        (max_length, ["--hidden-size", "20", "--num-heads", "4", "--encodings", "alibi"], "even rotary"),
        (s2_attn, ["--num-kv-heads", "3"], "--num-kv-heads 3 is not allowed with --num-heads 8"),
    ],
)
def test_the_benchmark_modules_check_their_model_first(module, argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        module.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].count("error:") == 1, err
