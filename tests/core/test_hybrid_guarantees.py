"""Per-layer hybrid encodings keep everything a plain patch guarantees: cached decoding, left
padding, save and reload, exact unpatch, a training step over every part with gradient
checkpointing, every backend equal to eager; and the recipes take the text form
(``"rope*3+nope"``: perplexity, lm-eval). Each layer against its plain twin and the SmolLM3 peer:
test_hybrid.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import decoded_and_full_logits, no_grad_logits, token_ids
from hybrid_cases import ATOL, LAYERS, MIXED, four_layer_model, hybrid, randomize

import hf_posenc
from hf_posenc.core.hybrid import canonical_request, check_request, matches_saved, parse_pattern_text
from hf_posenc.errors import InvalidParameterError

# -- everything a plain patch guarantees ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", list(MIXED))
def test_cached_decoding_equals_full_forward(family, name):
    model = hybrid(name, family)
    for step, full in decoded_and_full_logits(model, token_ids(2, 12), prompt=4):
        torch.testing.assert_close(step, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(MIXED))
def test_left_padded_batch_equals_each_sequence_alone(name):
    model = hybrid(name)
    long, short = token_ids(1, 10, seed=1), token_ids(1, 6, seed=2)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.cat([torch.ones(1, 10), torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], dim=1)]).long()
    with torch.no_grad():
        together = model(batch, attention_mask=mask).logits
        torch.testing.assert_close(together[0], model(long).logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(together[1, 4:], model(short).logits[0], atol=ATOL, rtol=0)
    options = dict(
        max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    generated = model.generate(batch, attention_mask=mask, **options)
    alone = model.generate(short, attention_mask=torch.ones_like(short), **options)
    assert torch.equal(generated.sequences[1, 10:], alone.sequences[0, 6:])
    for a, b in zip(generated.logits, alone.logits, strict=True):
        torch.testing.assert_close(a[1], b[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(MIXED))
def test_save_and_reload_gives_identical_logits(name, tmp_path):
    model = hybrid(name)
    ids = token_ids(2, 12)
    model.save_pretrained(tmp_path)
    reloaded = hf_posenc.from_pretrained(str(tmp_path))
    assert reloaded.config.posenc["encoding"] == "hybrid" and reloaded.config.posenc["format_version"] == 2
    assert hf_posenc.patch_info(reloaded) == hf_posenc.patch_info(model)
    for key, value in model.posenc.state_dict().items():
        assert torch.equal(reloaded.posenc.state_dict()[key], value), key
    torch.testing.assert_close(no_grad_logits(reloaded, ids), no_grad_logits(model, ids), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(MIXED))
def test_unpatch_restores_exactly(name):
    model = four_layer_model()
    ids = token_ids(2, 12)
    before = no_grad_logits(model, ids)
    keys, impl = list(model.state_dict()), model.config._attn_implementation
    hf_posenc.patch_model(model, MIXED[name][0])
    assert not torch.equal(no_grad_logits(model, ids), before)
    hf_posenc.unpatch_model(model)
    assert torch.equal(no_grad_logits(model, ids), before)
    assert list(model.state_dict()) == keys and model.config._attn_implementation == impl
    assert not hasattr(model.config, "posenc") and hf_posenc.patch_info(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_training_step_moves_every_part_and_checkpointing_gives_the_same_gradients():
    ids = token_ids(2, 12)
    models = [hybrid("t5/fox").train() for _ in range(2)]
    models[1].activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for model in models:
        model(ids, labels=ids).loss.backward()
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)
    model = models[0]
    before = {n: p.detach().clone() for n, p in model.posenc.named_parameters()}
    assert {n.split(".")[1] for n in before} == {"0", "1"}  # both parts have parameters
    for n, p in model.posenc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    for n, p in model.posenc.named_parameters():
        assert not torch.equal(p, before[n]), n


@pytest.mark.parametrize("name", list(MIXED))
def test_every_backend_equals_eager(name):
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    outputs = {}
    for backend in ("eager", "sdpa", "chunked", "flex", "auto"):
        model = four_layer_model()
        hf_posenc.patch_model(model, MIXED[name][0], backend=backend)
        randomize(model.posenc)
        outputs[backend] = no_grad_logits(model, ids, attention_mask=mask)
    for backend in ("sdpa", "chunked", "flex", "auto"):
        torch.testing.assert_close(outputs[backend][0], outputs["eager"][0], atol=ATOL, rtol=0)
        torch.testing.assert_close(outputs[backend][1, 3:], outputs["eager"][1, 3:], atol=ATOL, rtol=0)


# -- recipes ---------------------------------------------------------------------------------------------


def test_recipe_text_form():
    assert parse_pattern_text("rope*3+nope") == ["rope", "rope", "rope", "nope"]
    assert canonical_request("RoPE * 2 + NoPE") == "rope*2+nope"
    saved = {
        "encoding": "hybrid",
        "params": {"parts": [{"encoding": "rope"}, {"encoding": "nope"}], "layers": [0, 0, 0, 1] * 2},
    }
    assert matches_saved("rope*3+nope", saved) and not matches_saved("rope+nope", saved)
    assert not matches_saved("rope", saved) and matches_saved("alibi", {"encoding": "alibi"})
    check_request("rope*3+nope", {"theta": 500.0})
    with pytest.raises(InvalidParameterError, match="'sinusoidal' is not allowed in a per-layer pattern"):
        check_request("sinusoidal+rope")


def test_lm_eval_and_perplexity_load_a_pattern(tmp_path):
    """The recipes' loader patches a plain checkpoint with the text form and reloads a saved hybrid;
    a different pattern for a saved hybrid is refused."""
    from hf_posenc.core.loading import load_model

    model = four_layer_model()
    model.save_pretrained(tmp_path / "plain")
    loaded = load_model(str(tmp_path / "plain"), "rope*3+nope")
    assert hf_posenc.patch_info(loaded)["pattern"] == "rope*3+nope"
    loaded.save_pretrained(tmp_path / "hybrid")
    again = load_model(str(tmp_path / "hybrid"), "rope*3+nope")
    assert hf_posenc.patch_info(again) == hf_posenc.patch_info(loaded)
    with pytest.raises(
        ValueError, match="saved with encoding 'rope\\*3\\+nope'; cannot load it as 'rope\\+nope'"
    ):
        load_model(str(tmp_path / "hybrid"), "rope+nope")


def test_perplexity_cli_patches_a_plain_checkpoint_with_a_pattern(tmp_path, capsys):
    """`hf-posenc perplexity --encoding 'rope*3+nope' --encoding-param theta=500` evaluates the
    hybrid (the label names the pattern; theta reaches the rope part); a pattern with an embedding
    encoding is refused before any model loads."""
    import itertools
    import json

    from hf_posenc.recipes.cli import main
    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tiny import tiny_model
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    texts = [doc[:3000] for doc in itertools.islice(stdlib_documents(), 2)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    tiny_model("llama", vocab_size=len(tokenizer), max_positions=64, num_layers=LAYERS).save_pretrained(
        tmp_path / "m"
    )
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "valid.txt").write_text(texts[0][:1500])
    argv = ["perplexity", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "valid.txt")]
    argv += ["--train-length", "16", "--multiples", "1", "2", "--batch-size", "4", "--no-progress"]
    out = tmp_path / "report"
    assert (
        main([*argv, "--encoding", "rope*3+nope", "--encoding-param", "theta=500", "--output", str(out)]) == 0
    )
    document = json.loads((out / "results.json").read_text())
    (label,) = document["results"]
    assert "rope*3+nope" in label
    capsys.readouterr()
    assert main([*argv, "--encoding", "learned+rope", "--output", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "'learned' is not allowed in a per-layer pattern" in err and "Traceback" not in err
