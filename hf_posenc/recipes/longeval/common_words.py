"""RULER's common-words extraction (Hsieh et al. 2024, NVIDIA/RULER
``scripts/data/synthetic/common_words_extraction.py``; ``cwe`` in ``scripts/synthetic.yaml``).

A numbered list (``1. word 2. word ...``) holds 10 common words repeated ``freq_cw`` times and
many uncommon words repeated ``freq_ucw`` times, shuffled; the model must name the 10 common
ones. As in RULER: ``freq_cw = 30, freq_ucw = 3`` from 4096 tokens, ``6, 1`` below; one solved
example first (40 words repeated 10/3 times, or 20 words 3/1 times below 4096)::

    Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.
    1. word 2. word ...
    Question: What are the 10 most common words in the above list? Answer: The top 10 words that appear most often in the list are: 1. w 2. w ...
    Below is a numbered list of words. ... (the task itself, ending with the same answer prefix)

The number of uncommon words sets the length; up to a few extra words, each once, make it
exact (they change no answer). Scored with ``string_match_all`` (share of the 10 words in the
output). RULER draws words from ``wonderwords``; here they are generated (:mod:`.words`).
"""

from __future__ import annotations

import random

from .task import Instance, Task
from .words import pseudo_word

TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
COMMON = 10
#: (example words, example common repeats, example uncommon repeats, common repeats, uncommon repeats)
SHORT, LONG = (20, 3, 1, 6, 1), (40, 10, 3, 30, 3)


class WordPool:
    """An endless list of distinct pseudo-words drawn from one seed (grown on demand)."""

    def __init__(self, seed: int, avoid: set[str] | None = None) -> None:
        self.rng, self.seen = random.Random(seed), set(avoid or ())
        self.words: list[str] = []

    def take(self, count: int) -> list[str]:
        while len(self.words) < count:
            word = pseudo_word(self.rng, (1, 2))  # short, like wonderwords' English words
            if word not in self.seen:
                self.seen.add(word)
                self.words.append(word)
        return self.words[:count]


def numbered(words: list[str], start: int = 1) -> str:
    return " ".join(f"{start + i}. {word}" for i, word in enumerate(words))


def word_list(
    common: list[str], uncommon: list[str], common_repeats: int, uncommon_repeats: int, seed: int
) -> list[str]:
    """RULER's ``get_example``: common and uncommon words repeated, shuffled with a fixed seed."""
    words = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(words)
    return words


class CommonWords(Task):
    name = "cwe"
    description = "name the 10 most common words of a numbered list"
    citation = "RULER (Hsieh et al. 2024, NVIDIA/RULER) cwe"
    metric = "all"
    max_new_tokens = 120  # RULER's tokens_to_generate for common_words_extraction
    uses_depth = False

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        example_words, example_cr, example_ur, common_repeats, uncommon_repeats = (
            LONG if length >= 4096 else SHORT
        )
        pool = WordPool(rng.getrandbits(64))
        common = pool.take(COMMON)
        example = WordPool(rng.getrandbits(64), set(common)).take(example_words)
        shuffle_seed = rng.getrandbits(32)
        uncommon = WordPool(rng.getrandbits(64), set(common))
        padding = WordPool(rng.getrandbits(64), set(common))
        template = TEMPLATE + ANSWER_PREFIX
        example_list = word_list(example[:COMMON], example[COMMON:], example_cr, example_ur, shuffle_seed)
        shot = template.format(context=numbered(example_list)) + " " + numbered(example[:COMMON])
        pad_words = 2 * uncommon_repeats + 4

        def render(size: int, pad: int) -> str:
            words = word_list(common, uncommon.take(size), common_repeats, uncommon_repeats, shuffle_seed)
            extra = " " + numbered(padding.take(pad_words), len(words) + 1)  # each once: no answer changes
            context = numbered(words) + (extra[:pad] if pad else "")
            return shot + "\n" + template.format(context=context)

        probe = " " + numbered(padding.take(pad_words), 1_000_000)
        return Instance(render, tuple(common), pad_limit=len(probe))
