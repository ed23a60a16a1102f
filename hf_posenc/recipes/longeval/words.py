"""Random values for the synthetic tasks: numbers, UUIDs, words, variable names, coded words.

RULER (Hsieh et al. 2024, https://github.com/NVIDIA/RULER) draws its needle keys and its
common-words lists from the ``wonderwords`` package's English noun/adjective/verb lists. Those
lists are not a dependency here, so words are *generated*: pronounceable pseudo-words built
from consonant-vowel syllables by a seeded ``random.Random`` (nothing is fetched, the same seed
gives the same words on every machine). What the tasks test — finding a key, counting words —
does not depend on the words being English.
"""

from __future__ import annotations

import random
import string
import uuid

ONSETS = tuple("bcdfghjklmnprstvwz") + ("br", "ch", "cl", "dr", "fl", "gr", "pl", "sh", "st", "th", "tr")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "oo", "ou")
CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st")


def pseudo_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A lowercase pronounceable word of ``syllables`` (min, max) consonant-vowel syllables."""
    count = rng.randint(*syllables)
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(count))


def distinct_words(rng: random.Random, count: int, *, avoid: set[str] | None = None) -> list[str]:
    """``count`` different pseudo-words (none in ``avoid``), in the order drawn."""
    seen = set(avoid or ())
    words: list[str] = []
    while len(words) < count:
        word = pseudo_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def needle_key(rng: random.Random) -> str:
    """A RULER needle key of type ``words``: ``adjective-noun`` (here two pseudo-words)."""
    return f"{pseudo_word(rng, (1, 2))}-{pseudo_word(rng, (1, 3))}"


def number(rng: random.Random, digits: int = 7) -> str:
    """RULER's ``generate_random_number``: a uniform integer with exactly ``digits`` digits."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid4(rng: random.Random) -> str:
    """RULER's ``generate_random_uuid``: ``uuid.UUID(int=getrandbits(128), version=4)``."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def variable_name(rng: random.Random, letters: int = 5) -> str:
    """RULER variable tracking's variable names: ``letters`` random uppercase ASCII letters."""
    return "".join(rng.choices(string.ascii_uppercase, k=letters))


def coded_word(rng: random.Random, letters: int = 6) -> str:
    """RULER frequent-words extraction's coded words: ``letters`` random lowercase ASCII letters."""
    return "".join(rng.choices(string.ascii_lowercase, k=letters))


def sample_rng(seed: int, *parts: object) -> random.Random:
    """A ``random.Random`` keyed by ``seed`` and ``parts`` (a str seed is hashed with SHA-512 by
    ``random``, so the stream does not depend on ``PYTHONHASHSEED`` or the machine)."""
    return random.Random("|".join([str(seed), *map(str, parts)]))
