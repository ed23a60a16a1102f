"""RULER's frequent-words extraction (Hsieh et al. 2024, NVIDIA/RULER
``scripts/data/synthetic/freq_words_extraction.py``; ``fwe`` in ``scripts/synthetic.yaml``).

A "coded text" of random six-letter words whose counts follow a Zipf law: with ``V`` coded
words in random order, the k-th appears ``floor(n * k^-alpha / zeta(alpha))`` times (alpha = 2,
``zeta(2) = pi^2 / 6``), shuffled; the first is replaced by the noise word ``...``; the model
must name the three most frequent real words (ranks 2-4)::

    Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. <words>
    Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text? Answer: According to the coded text above, the three most frequently appeared words are:

``V = (length - 50) // 50`` as RULER sets it (at least 10 here, so short prompts still have a
tail); ``n`` sets the length, from the smallest ``n`` whose counts rank the three answers
strictly above every other word; up to a few extra coded words, each once, make the length
exact (they change no answer). Scored with ``string_match_all``.
"""

from __future__ import annotations

import math
import random

from .task import Instance, Task
from .words import coded_word

TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
ALPHA = 2.0
ZETA_ALPHA = math.pi**2 / 6  # zeta(2)
WORD_LETTERS = 6


def zipf_counts(words: int, vocabulary: int) -> list[int]:
    """RULER's counts: ``floor(words * k^-alpha / zeta(alpha))`` for ranks k = 1..vocabulary."""
    return [int(words * k**-ALPHA / ZETA_ALPHA) for k in range(1, vocabulary + 1)]


def smallest_word_count(vocabulary: int) -> int:
    """The least ``n`` whose counts rank words 2, 3, 4 strictly above every later one (and above 1,
    the count of the padding words)."""
    n = 1
    while True:
        c = zipf_counts(n, vocabulary)
        if c[1] > c[2] > c[3] > max(c[4], 1):
            return n
        n += 1


class FrequentWords(Task):
    name = "fwe"
    description = "name the 3 most frequent words of a Zipf-distributed coded text"
    citation = "RULER (Hsieh et al. 2024, NVIDIA/RULER) fwe"
    metric = "all"
    max_new_tokens = 50  # RULER's tokens_to_generate for freq_words_extraction
    uses_depth = False

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        vocabulary = max(10, (length - self.max_new_tokens) // 50)
        vocab: set[str] = set()
        while len(vocab) < vocabulary:
            vocab.add(coded_word(rng, WORD_LETTERS))
        ranked = sorted(vocab)
        shuffle_seed = rng.getrandbits(32)
        random.Random(shuffle_seed).shuffle(ranked)
        ranked[0] = "..."  # RULER: the top-ranked word is noise
        padding: list[str] = []
        while len(padding) < 8:
            word = coded_word(rng, WORD_LETTERS)
            if word not in vocab and word not in padding:
                padding.append(word)
        extra = " " + " ".join(padding)
        start = smallest_word_count(vocabulary)
        template = TEMPLATE + ANSWER_PREFIX

        def render(size: int, pad: int) -> str:
            counts = zipf_counts(start + size, vocabulary)
            words = [word for word, count in zip(ranked, counts, strict=True) for _ in range(count)]
            random.Random(shuffle_seed).shuffle(words)
            return template.format(context=" ".join(words) + (extra[:pad] if pad else ""))

        return Instance(render, tuple(ranked[1:4]), pad_limit=len(extra))
