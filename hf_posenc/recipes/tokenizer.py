"""Train a small byte-level BPE tokenizer on local text (no download), as a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidParameterError

END_OF_TEXT = "<|endoftext|>"
PAD = "<pad>"
#: the smallest vocabulary :func:`train_bpe_tokenizer` trains: the 256 bytes, some merges, the specials
MIN_VOCAB_SIZE = 300


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 2):
    """Byte-level BPE (GPT-2 style) trained on ``texts``; ``<|endoftext|>`` is bos/eos, ``<pad>`` pads.

    Every byte is in the initial alphabet, so any text can be encoded. Deterministic for a
    given input order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise InvalidParameterError(
            f"vocab_size={vocab_size} is too small; allowed: >= {MIN_VOCAB_SIZE} (256 bytes + merges + specials)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD
    )
