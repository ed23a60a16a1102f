"""Passkey retrieval, the protocol of Landmark Attention (Mohtashami & Jaggi 2023, "Landmark
Attention: Random-Access Infinite Context Length for Transformers", epfml/landmark-attention,
``llama/run_test.py``) as YaRN (Peng et al. 2023, jquesnelle/yarn ``eval/passkey.py``) and
LongLoRA (Chen et al. 2023, dvlab-research/LongLoRA ``passkey_retrivial.py``) run it.

The prompt is, lines joined by ``\\n``::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.
    <filler: the first P characters of "The grass is green. ... There and back again." repeated, joined by " ">
    The pass key is N. Remember it. N is the pass key.
    <filler: the first S characters of the same text>
    What is the pass key? The pass key is

with N uniform in [1, 50000]. The filler holds ``P + S`` characters with ``P = int((P + S) * depth)``
(YaRN's ``depth_ratio``); ``P + S`` is chosen so the prompt is exactly the requested number of
tokens. Scored as YaRN does: correct when the first integer the model generates equals N.

``Passkey(max_key=..., instruction=False)`` is a variant for models too small for the protocol
(the study's retrieval experiment, :mod:`hf_posenc.recipes.study.retrieval`): keys uniform in
``[1, max_key]`` and the prompt without its instruction line; the filler, key line, question
and scoring are unchanged. ``longeval`` and the lm-eval tasks use the protocol (``Passkey()``).
"""

from __future__ import annotations

import random

from ...errors import InvalidParameterError
from .task import Instance, Task, repeated_text

DESCRIPTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
#: Landmark/YaRN/LongLoRA draw the key uniformly from [1, 50000]
MAX_KEY = 50000


class Passkey(Task):
    name = "passkey"
    description = "find a 1-5 digit pass key in repeated filler"
    citation = "Landmark Attention (Mohtashami & Jaggi 2023) protocol, as YaRN and LongLoRA run it"
    metric = "first_integer"
    max_new_tokens = 10  # Landmark/YaRN: max_new_tokens=10

    def __init__(self, max_key: int = MAX_KEY, instruction: bool = True) -> None:
        if isinstance(max_key, bool) or not isinstance(max_key, int) or max_key < 1:
            raise InvalidParameterError(
                f"passkey: max_key={max_key!r} is not allowed; allowed: an integer >= 1"
            )
        self.max_key, self.instruction = max_key, instruction

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        key = rng.randint(1, self.max_key)
        information = f"The pass key is {key}. Remember it. {key} is the pass key."
        head = [DESCRIPTION] if self.instruction else []

        def render(size: int, pad: int) -> str:
            prefix = int(size * depth)
            lines = [
                *head,
                repeated_text(GARBAGE, prefix, " "),
                information,
                repeated_text(GARBAGE, size - prefix, " "),
                QUESTION,
            ]
            return "\n".join(lines)

        return Instance(render, (str(key),))
