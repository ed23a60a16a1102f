"""Helpers of the long-context retrieval tests (tests/recipes/test_longeval_*.py): tokenizers of
three kinds built offline, a reference solver written from the task definitions (Landmark
Attention's passkey, RULER's synthetic tasks) that reads the answers from a prompt's text —
independent of the generator in hf_posenc.recipes.longeval — and stand-in models whose
``generate`` answers with it (right) or with wrong numbers."""

from __future__ import annotations

import collections
import functools
import itertools
import re

import torch
from torch import nn


def _fast(tokenizer_object, **specials):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **specials)


def byte_level_tokenizer(bos: bool = True):
    """256 byte tokens, no merges (GPT-2's byte alphabet); adds a BOS token in front of every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{symbol: i + 2 for i, symbol in enumerate(alphabet)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return _fast(tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def char_level_tokenizer(characters: str | None = None):
    """One token per character of ``characters`` (default: printable ASCII and newline); others -> <unk>."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    characters = characters if characters is not None else string.printable
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(dict.fromkeys(characters))}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return _fast(tokenizer, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


@functools.cache
def bpe_tokenizer():
    """A byte-level BPE of 600 tokens trained on a few standard-library files."""
    from hf_posenc.recipes.data import stdlib_documents
    from hf_posenc.recipes.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(itertools.islice(stdlib_documents(), 8), vocab_size=600)


@functools.cache
def longeval_tokenizers():
    """``{"bpe": trained BPE, "byte": byte-level with BOS, "char": character-level}``."""
    return {"bpe": bpe_tokenizer(), "byte": byte_level_tokenizer(), "char": char_level_tokenizer()}


# -- reference solvers: the answer of a prompt, read from its text -----------------------------


def solve(prompt: str) -> list[str]:
    """The expected answers of a passkey / RULER prompt, by the task's definition."""
    if "What is the pass key?" in prompt:
        return re.findall(r"The pass key is (\d+)\. Remember it\.", prompt)
    question = re.search(
        r"What (?:is|are all) the special magic \w+ for (.+?) mentioned in the provided text\?", prompt
    )
    if question:
        keys = re.split(r", and |, ", question.group(1))
        needles = re.findall(r"^One of the special magic \w+ for (\S+) is: (\S+)\.$", prompt, flags=re.M)
        return [value for key in keys for k, value in needles if k == key]
    if "Memorize and track the chain(s)" in prompt:
        value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
        start = re.findall(r"VAR (\w+) = (\d+)", prompt)
        edges = re.findall(r"VAR (\w+) = VAR (\w+)", prompt)
        names = [name for name, v in start if v == value]
        for _ in edges:
            names += [a for a, b in edges if b in names and a not in names]
        return names
    if "Below is a numbered list of words." in prompt:
        last = prompt.rsplit("Below is a numbered list of words.", 1)[1].split("\nQuestion:")[0]
        counts = collections.Counter(re.findall(r"\d+\. (\S+)", last))
        return [word for word, _ in counts.most_common(10)]
    if "Read the following coded text" in prompt:
        text = prompt.split("Find the three most frequently appeared coded words. ", 1)[1].split(
            "\nQuestion:"
        )[0]
        counts = collections.Counter(word for word in text.split() if word != "...")
        return [word for word, _ in counts.most_common(3)]
    raise AssertionError(f"not a known task prompt: {prompt[:80]!r}")


def wrong(answers: list[str]) -> str:
    """An answer that is wrong on every count: each number changed, no word of the answers."""
    if all(a.isdigit() for a in answers):
        return ", ".join(str(int(a) + 1) for a in answers)
    if all(re.fullmatch(r"[0-9a-f-]{36}", a) for a in answers):
        return ", ".join(a[:-1] + ("0" if a[-1] != "0" else "1") for a in answers)
    return "0"


class ScriptedLM(nn.Module):
    """A stand-in causal LM whose ``generate`` continues each prompt with ``respond(prompt_text)``
    (cut to ``max_new_tokens``), as transformers' ``generate`` returns prompt + new tokens."""

    def __init__(self, tokenizer, respond) -> None:
        super().__init__()
        self.tokenizer, self.respond = tokenizer, respond
        self.prompt_lengths: list[int] = []

    def generate(self, input_ids, attention_mask=None, max_new_tokens=8, pad_token_id=0, **kwargs):
        rows = []
        for row in input_ids:
            self.prompt_lengths.append(row.numel())
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            new = self.tokenizer(" " + self.respond(text), add_special_tokens=False)["input_ids"][
                :max_new_tokens
            ]
            rows.append(new)
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows], dtype=torch.long)
        return torch.cat([input_ids, new], dim=1)


def oracle_lm(tokenizer) -> ScriptedLM:
    """Answers every prompt correctly (the reference solver's answers)."""
    return ScriptedLM(tokenizer, lambda text: ", ".join(solve(text)))


def wrong_lm(tokenizer) -> ScriptedLM:
    """Answers every prompt with wrong numbers / no answer word."""
    return ScriptedLM(tokenizer, lambda text: wrong(solve(text)))
