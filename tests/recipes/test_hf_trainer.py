"""The Hugging Face Trainer and TRL path (issue 24): a patched model trains with
``transformers.Trainer`` and TRL's ``SFTTrainer`` (padding-free packing) as any model does; its
checkpoints reload with their encoding and its tensors; a run resumed from a Trainer checkpoint
ends where the uninterrupted run ends; gradient checkpointing changes no number; LoRA through
peft (``apply_lora``) trains the adapters and the encoding and leaves the base weights alone."""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc.recipes.tiny import tiny_model

VOCAB = 64


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Trainer and SFTTrainer initialise accelerate's process-wide state (SFTConfig defaults to
    bf16 mixed precision); reset it afterwards so later in-process runs (hf-posenc train, which
    asks for its own precision) start from a clean state, as separate programs would."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _patched() -> torch.nn.Module:
    model = tiny_model("llama", vocab_size=VOCAB, max_positions=64, seed=0)
    hf_posenc.patch_model(model, "t5", num_buckets=8, max_distance=32)  # learned tensors: posenc.*
    return model.train()


def _dataset():
    from datasets import Dataset

    ids = torch.randint(0, VOCAB, (16, 32), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _trainer(model, output_dir, **overrides):
    from transformers import Trainer, TrainingArguments

    settings = dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=model, args=TrainingArguments(**{**settings, **overrides}), train_dataset=_dataset())


def _posenc(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "posenc" in k}


@pytest.mark.slow  # three short Trainer runs (seconds)
def test_trainer_checkpoints_reload_with_their_encoding_and_resume_where_the_run_ends(tmp_path):
    model = _patched()
    before = _posenc(model)
    _trainer(model, tmp_path / "a").train()
    after = _posenc(model)
    assert before and any(not torch.equal(before[k], after[k]) for k in before)  # the encoding trained

    reloaded = hf_posenc.from_pretrained(str(tmp_path / "a" / "checkpoint-4"))
    assert hf_posenc.patch_info(reloaded)["encoding"] == "t5"
    assert hf_posenc.patch_info(reloaded)["params"]["num_buckets"] == 8
    for key, value in _posenc(reloaded).items():
        torch.testing.assert_close(value, after[key])

    resumed = _patched()
    _trainer(resumed, tmp_path / "b").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    for key, value in resumed.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two one-step Trainer runs
def test_gradient_checkpointing_changes_no_number(tmp_path):
    plain, checkpointed = _patched(), _patched()
    _trainer(plain, tmp_path / "plain", max_steps=1, save_strategy="no").train()
    _trainer(
        checkpointed, tmp_path / "gc", max_steps=1, save_strategy="no", gradient_checkpointing=True
    ).train()
    for key, value in checkpointed.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a short Trainer run with peft
def test_lora_through_peft_trains_adapters_and_the_encoding_only(tmp_path):
    from hf_posenc.recipes.training.lora import apply_lora, merge_lora

    model = _patched()
    base = {k: v.clone() for k, v in model.state_dict().items() if "posenc" not in k}
    encoding = _posenc(model)
    wrapped = apply_lora(model, r=4, alpha=8, dropout=0.0, targets=None)
    _trainer(wrapped, tmp_path / "lora", max_steps=2, save_strategy="no").train()
    merged = merge_lora(wrapped)
    trained = merged.state_dict()
    assert any(not torch.equal(encoding[k], trained[k]) for k in encoding)  # the encoding trained fully
    frozen = [k for k in base if "proj" not in k]  # embeddings, norms, head: not LoRA targets
    assert frozen and all(torch.equal(base[k], trained[k]) for k in frozen)
    assert any(not torch.equal(base[k], trained[k]) for k in base if "q_proj" in k)  # adapters merged in
    merged.save_pretrained(tmp_path / "merged")
    reloaded = hf_posenc.from_pretrained(str(tmp_path / "merged"))
    assert hf_posenc.patch_info(reloaded)["encoding"] == "t5"


@pytest.mark.slow  # a short SFTTrainer run
def test_trl_sft_trainer_with_padding_free_packing(tmp_path):
    import trl  # in the dev extra: CI runs this test
    from datasets import Dataset

    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    documents = [d[:400] for d in list(stdlib_documents())[:12]]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=300)
    model = tiny_model("llama", vocab_size=len(tokenizer), max_positions=128, seed=0)
    hf_posenc.patch_model(model, "alibi")
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("position_ids")), with_kwargs=True)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=2, packing=True,
        padding_free=True, max_length=128, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
        logging_steps=1, dataset_text_field="text", disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"text": documents}),
        processing_class=tokenizer,
    )
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    # padding-free: one row of several documents, positions restarting at 0 for each
    positions = next(p for p in seen if p is not None)[0]
    assert positions.shape[0] > 0 and int((positions == 0).sum()) >= 2
    reloaded = hf_posenc.from_pretrained(str(tmp_path / "sft" / "checkpoint-2"))
    assert hf_posenc.patch_info(reloaded)["encoding"] == "alibi"
