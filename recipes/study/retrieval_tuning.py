"""Can the default study's model learn passkey retrieval, and do the encodings differ past the
training length? A quick loop for tuning the study's retrieval experiment (README, "Tuning the
retrieval experiment"); not the study itself.

Trains the model the default `hf-posenc study` trains (tiny Llama: hidden 128, 4 layers, 4 heads,
RoPE; the study's byte-level BPE of 2048 tokens trained on the standard library's sources;
128-token blocks, batch 16, AdamW lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices, clip 1,
linear warm-up then cosine to a tenth) on batches in which each row is a passkey document
(`hf_posenc.recipes.longeval.training_data.training_documents`, one block each) with
probability `--share`, else a block of the corpus. Every `--eval-every` steps it prints the base's
passkey accuracy at 1x; then it continues the base `--cont-steps` per encoding (warm-up 10%,
passkey share `--cont-share`) and prints each row's accuracy per length and depth.

Accuracy is the share of prompts (`--samples` per depth 0, 0.5, 1; the study's evaluation
prompts, `hf_posenc.recipes.study.retrieval.evaluation_samples`) whose answer tokens " N." are
all the argmax under teacher forcing — what greedy decoding returns when it is right (the
study's scoring, first integer equals N, can only differ where greedy writes the key in other
tokens). One forward per prompt: much cheaper than the study's generation.

    OMP_NUM_THREADS=1 python recipes/study/retrieval_tuning.py --max-key 999 --share 1.0 --steps 600 \\
        --encodings rope alibi nope --cont-share 0.5 --multiples 1 2 4 8

Downloads nothing; writes the tokenizer, token caches and base weights under `--cache`.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-key", type=int, default=50000, help="pass keys in [1, N]")
    parser.add_argument("--no-instruction", action="store_true", help="drop the prompt's instruction line")
    parser.add_argument(
        "--share", type=float, default=0.25, help="passkey rows per base batch (expected share)"
    )
    parser.add_argument("--steps", type=int, default=1000, help="base pretraining steps")
    parser.add_argument("--encodings", nargs="*", default=[], help="continued pretraining, one row each")
    parser.add_argument("--cont-steps", type=int, default=300)
    parser.add_argument("--cont-share", type=float, default=None, help="default: --share")
    parser.add_argument("--documents", type=int, default=4000, help="distinct passkey documents")
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--multiples", type=int, nargs="*", default=[1])
    parser.add_argument("--samples", type=int, default=8, help="prompts per length and depth")
    parser.add_argument("--load", default=None, help="base weights saved by an earlier run (skips the base)")
    parser.add_argument(
        "--cache", default="retrieval-tuning", help="folder for the tokenizer, caches, weights"
    )
    parser.add_argument("--tag", default="run")
    args = parser.parse_args()

    import numpy as np
    import torch

    import hf_posenc
    from hf_posenc.models import DEFAULT_FAMILY
    from hf_posenc.recipes.longeval.passkey import Passkey
    from hf_posenc.recipes.longeval.training_data import training_documents
    from hf_posenc.recipes.study.retrieval import evaluation_samples
    from hf_posenc.recipes.tiny import tiny_model

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(cache)
    length = args.train_length
    eos = tokenizer.eos_token_id
    corpus = _corpus_blocks(cache, tokenizer, length)
    task = Passkey(args.max_key, not args.no_instruction)
    documents_file = cache / f"passkey-{length}-{args.documents}-{args.max_key}-{args.no_instruction}.pt"
    if not documents_file.is_file():
        rows = []
        for text in training_documents(task, tokenizer, length - 1, args.documents, seed=0):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(ids[:length] + [eos] * (length - len(ids)))
        torch.save(torch.tensor(rows), documents_file)
    passkey = torch.load(documents_file)
    print(f"[{args.tag}] corpus blocks {len(corpus)}, passkey documents {len(passkey)}", flush=True)
    prompts = {m: evaluation_samples(task, tokenizer, length * m, args.samples, 0)[1] for m in args.multiples}

    def accuracy(model, multiple: int) -> tuple[float, dict[float, float]]:
        model.eval()
        found: dict[float, list[bool]] = {}
        with torch.no_grad():
            for sample in prompts[multiple]:
                prompt = tokenizer(sample.prompt)["input_ids"]
                answer = tokenizer(f" {sample.answers[0]}.", add_special_tokens=False)["input_ids"]
                logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]  # (T, V)
                predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
                found.setdefault(sample.depth, []).append(predicted == answer)
        model.train()
        by_depth = {depth: sum(v) / len(v) for depth, v in found.items()}
        return sum(by_depth.values()) / len(by_depth), by_depth

    def train(model, steps: int, warmup: float, share: float, label: str, seed: int) -> None:
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        others = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(0.9, 0.95),
        )
        warm = max(1, int(steps * warmup))

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        generator = torch.Generator().manual_seed(seed)
        draws = np.random.default_rng(seed)
        model.train()
        began = time.time()
        for step in range(1, steps + 1):
            rows = int(draws.binomial(args.batch_size, share))
            batch = torch.cat(  # (B, T)
                [
                    passkey[torch.randint(len(passkey), (rows,), generator=generator)],
                    corpus[torch.randint(len(corpus), (args.batch_size - rows,), generator=generator)],
                ]
            )
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % args.eval_every == 0 or step == steps:
                at_1x, by_depth = accuracy(model, args.multiples[0])
                print(
                    f"[{args.tag}] {label} step {step}: loss {loss.item():.3f}, passkey at "
                    f"{args.multiples[0]}x {at_1x:.0%} {_depths(by_depth)} ({time.time() - began:.0f} s)",
                    flush=True,
                )

    def report(model, label: str) -> None:
        cells = []
        for multiple in args.multiples:
            overall, by_depth = accuracy(model, multiple)
            cells.append(f"{multiple}x {overall:.0%} {_depths(by_depth)}")
        print(f"[{args.tag}] FINAL {label}: " + "  ".join(cells), flush=True)

    model = tiny_model(
        DEFAULT_FAMILY,
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        max_positions=length * 16,
        seed=0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.load:
        model.load_state_dict(torch.load(args.load))
    else:
        train(model, args.steps, 0.05, args.share, "base", seed=0)
        torch.save(model.state_dict(), cache / f"base-{args.tag}.pt")
    report(model, "rope (base)")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    share = args.share if args.cont_share is None else args.cont_share
    for encoding in args.encodings:
        model.load_state_dict(base)
        hf_posenc.patch_model(model, encoding)
        train(model, args.cont_steps, 0.1, share, encoding, seed=1)
        report(model, encoding)
        hf_posenc.unpatch_model(model)


def _depths(by_depth: dict) -> str:
    return "{" + ", ".join(f"{depth:g}: {value:.0%}" for depth, value in by_depth.items()) + "}"


def _tokenizer(cache: Path):
    from transformers import AutoTokenizer

    folder = cache / "tokenizer"
    if not folder.is_dir():
        from hf_posenc.recipes.data import BUILTIN_STDLIB, read_documents
        from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

        documents = read_documents([BUILTIN_STDLIB], text_field="text", split="train")
        train_bpe_tokenizer(documents, vocab_size=2048).save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


def _corpus_blocks(cache: Path, tokenizer, length: int):
    """The study's training stream (documents joined by eos) as (N, length) blocks."""
    import numpy as np
    import torch

    stream_file = cache / "corpus.npy"
    if not stream_file.is_file():
        from hf_posenc.recipes.data import BUILTIN_STDLIB, read_documents

        ids: list[int] = []
        for text in read_documents([BUILTIN_STDLIB], text_field="text", split="train"):
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        np.save(stream_file, np.array(ids, dtype=np.int32))
    stream = np.load(stream_file)
    return torch.from_numpy(stream[: len(stream) // length * length].reshape(-1, length).astype(np.int64))


if __name__ == "__main__":
    main()
