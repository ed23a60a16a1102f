"""RULER's variable tracking (Hsieh et al. 2024, NVIDIA/RULER
``scripts/data/synthetic/variable_tracking.py``; ``vt`` in ``scripts/synthetic.yaml``: noise
haystack, one chain of four hops).

A chain ``VAR A = 12345``, ``VAR B = VAR A``, ... ``VAR E = VAR D`` (five-letter uppercase names,
the value uniform in [10000, 99999]) is spread, in order, over the lines of the noise haystack
at random positions; the model must name every variable that holds the value::

    Memorize and track the chain(s) of variable assignment hidden in the following text.

    <haystack with the chain>
    Question: Find all variables that are assigned the value 12345 in the text above. Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned the value 12345, they are:

(RULER's template and answer prefix, the latter ending in a space.) Scored with
``string_match_all``: the share of the five names in the output. The chain is spread over the
whole text, so ``depth`` does not apply. RULER's optional in-context example is off by default
there and here.
"""

from __future__ import annotations

import random

from .niah import NOISE
from .task import Instance, Task, lines_with_inserts, repeated_text
from .words import variable_name

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
HOPS = 4


class VariableTracking(Task):
    name = "vt"
    description = "name the 5 variables a value passes through (one chain, 4 hops)"
    citation = "RULER (Hsieh et al. 2024, NVIDIA/RULER) vt"
    metric = "all"
    max_new_tokens = 30  # RULER's tokens_to_generate for variable_tracking
    uses_depth = False

    def instance(self, rng: random.Random, length: int, depth: float) -> Instance:
        names: list[str] = []
        while len(names) < HOPS + 1:
            name = variable_name(rng)
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"]
        chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(HOPS)]
        fractions = sorted(rng.random() for _ in chain)
        inserts = list(zip(fractions, chain, strict=True))
        template = TEMPLATE + ANSWER_PREFIX

        def render(size: int, pad: int) -> str:
            text = repeated_text(NOISE, size, "\n")
            lines = text.split("\n") if text else []
            context = "\n".join(lines_with_inserts(lines, inserts)).replace(". \n", ".\n")
            return template.format(context=context, query=value, num_v=HOPS + 1)

        return Instance(render, tuple(names))
