"""RULER's needle-in-a-haystack tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?", NVIDIA/RULER ``scripts/data/synthetic/niah.py`` with the
settings of ``scripts/synthetic.yaml`` and the template of ``scripts/data/synthetic/constants.py``).

Needles read ``One of the special magic {numbers|uuids} for {key} is: {value}.``, inserted between
the lines of a haystack: ``noise`` (the line "The grass is green. ... There and back again."
repeated) or ``needle`` (distractor needles with other keys). The prompt (RULER's template and
answer prefix; "Some ... are" becomes "A ... is" when one value is asked for)::

    Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers afterwards.
    <haystack with the needles>
    What are all the special magic numbers for {query} mentioned in the provided text? The special magic numbers for {query} mentioned in the provided text are

Scored with RULER's ``string_match_all``: the share of the expected values found in the output.

RULER's ``essay`` haystack (Paul Graham's essays) is a download, so the tasks that use it
(``niah_single_2/3``, ``niah_multikey_1``, ``niah_multivalue``, ``niah_multiquery``) run here on
the ``noise`` haystack; ``niah_multikey_2``/``_3`` use the ``needle`` haystack as RULER does. The
haystack is cut to a number of characters (its last line may be partial) so the prompt has
exactly the requested length; the needle of the first answer sits at ``depth`` (a fraction of
the haystack's lines), the others at random lines, as RULER places them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from .task import Instance, Task, lines_with_inserts, repeated_text
from .words import needle_key, number, uuid4

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "words": needle_key,
    "numbers": number,
    "uuids": uuid4,
}


@dataclasses.dataclass(frozen=True)
class NiahSetting:
    """RULER's ``niah`` arguments: haystack type, key/value types and needle counts."""

    haystack: str  # noise | needle
    keys: str = "words"
    values: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


class NeedleInHaystack(Task):
    metric = "all"
    max_new_tokens = 128  # RULER's tokens_to_generate for niah
    setting: NiahSetting

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        setting = self.setting
        draw_key, draw_value = GENERATORS[setting.keys], GENERATORS[setting.values]
        keys: list[str] = []
        while len(keys) < max(setting.num_keys, setting.num_queries):
            key = draw_key(rng)
            if key not in keys:
                keys.append(key)
        values = [[draw_value(rng) for _ in range(setting.num_values)] for _ in keys]
        queried = rng.sample(range(len(keys)), setting.num_queries)
        answers = tuple(value for i in queried for value in values[i])
        first = (queried[0], 0)
        inserts = []
        for i, key in enumerate(keys):
            for j, value in enumerate(values[i]):
                fraction = depth if (i, j) == first else rng.random()
                text = NEEDLE.format(type_needle_v=setting.values, key=key, value=value)
                inserts.append((fraction, text))
        rng.shuffle(inserts)  # RULER shuffles the needles; those at one line keep this order
        queries = [keys[i] for i in queried]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_needle_v = TEMPLATE + ANSWER_PREFIX, setting.values
        if setting.num_queries * setting.num_values == 1:  # RULER's singular form
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(old, new)
            type_needle_v = type_needle_v[:-1]
        haystack = self._haystack(rng, set(keys), draw_key, draw_value)

        def render(size: int, pad: int) -> str:
            text = haystack(size)
            lines = text.split("\n") if text else []
            context = "\n".join(lines_with_inserts(lines, inserts))
            return template.format(type_needle_v=type_needle_v, context=context, query=query)

        return Instance(render, answers)

    def _haystack(
        self,
        rng: random.Random,
        keys: set[str],
        draw_key: Callable[[random.Random], str],
        draw_value: Callable[[random.Random], str],
    ) -> Callable[[int], str]:
        """The first ``size`` characters of the haystack, lines joined by ``\\n``."""
        if self.setting.haystack == "noise":
            return lambda size: repeated_text(NOISE, size, "\n")
        seed = rng.getrandbits(64)
        lines: list[str] = []
        text = [""]
        distractors = random.Random(seed)

        def needles(size: int) -> str:
            while len(text[0]) < size:
                key = draw_key(distractors)
                if key in keys:
                    continue
                lines.append(
                    NEEDLE.format(type_needle_v=self.setting.values, key=key, value=draw_value(distractors))
                )
                text[0] = "\n".join(lines)
            return text[0][:size]

        return needles


def _task(name: str, description: str, setting: NiahSetting, ruler: str) -> type[NeedleInHaystack]:
    attributes = {
        "name": name,
        "description": description,
        "setting": setting,
        "citation": f"RULER (Hsieh et al. 2024, NVIDIA/RULER) {ruler}",
        "__doc__": f"{description} (RULER {ruler}).",
    }
    return type(f"Niah_{name}", (NeedleInHaystack,), attributes)


NIAH_TASKS = [
    _task("niah_single", "one number needle in the noise haystack", NiahSetting("noise"), "niah_single_1"),
    _task(
        "niah_single_uuid",
        "one UUID needle in the noise haystack",
        NiahSetting("noise", values="uuids"),
        "niah_single_3 (noise haystack instead of essays)",
    ),
    _task(
        "niah_multikey",
        "the number of one of 4 keys, noise haystack",
        NiahSetting("noise", num_keys=4),
        "niah_multikey_1 (noise haystack instead of essays)",
    ),
    _task(
        "niah_multikey_2",
        "one number needle among distractor needles",
        NiahSetting("needle"),
        "niah_multikey_2",
    ),
    _task(
        "niah_multikey_3",
        "one UUID-keyed UUID needle among distractor needles",
        NiahSetting("needle", keys="uuids", values="uuids"),
        "niah_multikey_3",
    ),
    _task(
        "niah_multivalue",
        "all 4 numbers of one key, noise haystack",
        NiahSetting("noise", num_values=4),
        "niah_multivalue (noise haystack instead of essays)",
    ),
    _task(
        "niah_multiquery",
        "the numbers of 4 keys, noise haystack",
        NiahSetting("noise", num_keys=4, num_queries=4),
        "niah_multiquery (noise haystack instead of essays)",
    ),
]
