"""Long-context retrieval: the passkey test and RULER's synthetic tasks, generated offline.

- tasks, one module per family, each citing its source: :mod:`.passkey` (Landmark Attention's
  protocol, as YaRN and LongLoRA run it), :mod:`.niah` (RULER's needle-in-a-haystack variants),
  :mod:`.variable_tracking`, :mod:`.common_words`, :mod:`.frequent_words` (RULER); their
  registry in :mod:`.tasks`;
- prompts of exactly the requested number of the evaluated model's tokens (:mod:`.fit`), from
  seeded values (:mod:`.words`);
- scoring as the sources define it (:mod:`.scoring`).
"""
