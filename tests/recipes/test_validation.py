"""--eval-every N (issue 24): a held-out loss every N steps and at the end, equal to the mean
next-token cross-entropy of the model at that step on the held-out blocks, written to
eval_losses.json and logged to the trackers as eval_loss; refused without held-out text."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from hf_posenc.errors import InvalidParameterError
from hf_posenc.recipes.data import read_documents, stdlib_documents, tokenize_documents
from hf_posenc.recipes.tiny import tiny_model
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer
from hf_posenc.recipes.training import TrainConfig, train
from hf_posenc.recipes.training.config import preflight


def test_eval_every_without_held_out_text_is_refused_before_loading(tmp_path):
    (tmp_path / "train.txt").write_text("some text\n")
    config = TrainConfig(
        model="m", output_dir=str(tmp_path / "o"), data=[str(tmp_path / "train.txt")], eval_every=5
    )
    with pytest.raises(InvalidParameterError, match="--eval-every 5 needs held-out text"):
        preflight(config, model=torch.nn.Linear(1, 1), tokenizer=object())
    with pytest.raises(InvalidParameterError, match="eval_every"):
        TrainConfig(model="m", output_dir="o", eval_every=-1)


@pytest.mark.slow  # a 4-step training run (seconds)
def test_eval_loss_is_the_held_out_cross_entropy_and_reaches_the_trackers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    documents = list(stdlib_documents())[:8]
    tokenizer = train_bpe_tokenizer(documents, vocab_size=300)
    (tmp_path / "train.txt").write_text("\n\n".join(documents[:6]))
    (tmp_path / "held.txt").write_text("\n\n".join(documents[6:]))
    model = tiny_model("llama", vocab_size=len(tokenizer), max_positions=64)
    config = TrainConfig(
        model="tiny", output_dir=str(tmp_path / "run"), data=[str(tmp_path / "train.txt")], seq_len=32,
        batch_size=2, max_steps=4, eval_every=3, eval_data=[str(tmp_path / "held.txt")], eval_tokens=128,
        report_to=["tensorboard"],
    )  # fmt: skip
    result = train(config, model=model, tokenizer=tokenizer, progress=False)
    history = json.loads((tmp_path / "run" / "eval_losses.json").read_text())
    assert [h["step"] for h in history] == [3, 4]  # every 3 steps and at the end
    assert all(h["blocks"] == 4 and h["seq_len"] == 32 for h in history)

    # reference: the final weights, the first 4 x 32 held-out tokens, plain cross-entropy
    final = tiny_model("llama", vocab_size=len(tokenizer), max_positions=64)
    final.load_state_dict(load_file(str(result.final_dir / "model.safetensors")), strict=False)
    tokens = tokenize_documents(read_documents([str(tmp_path / "held.txt")]), tokenizer, max_tokens=128)
    blocks = tokens[:128].view(4, 32)
    with torch.no_grad():
        logits = final.eval()(blocks).logits  # (4, 32, V)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), blocks[:, 1:].flatten()).item()
    assert history[-1]["eval_loss_nats"] == pytest.approx(expected, rel=1e-4)

    events = sorted((tmp_path / "run" / "hf-posenc").glob("events.out.tfevents.*"))  # hparams: a subfolder
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    logged = [(e.step, e.value) for e in accumulator.Scalars("eval_loss")]
    assert [step for step, _ in logged] == [3, 4]
    assert logged[-1][1] == pytest.approx(history[-1]["eval_loss_nats"], rel=1e-6)
