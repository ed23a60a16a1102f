"""The recipes: what runs the patching library at scale — the command line (``cli``), training
(``training``), evaluation (``evaluation``, ``integrations`` for lm-eval), the extrapolation
study (``study``), benchmarks (``benchmark``) and their helpers (``data``, ``tokenizer``,
``preflight``, ``provenance``, ``catalogue``, ``tiny``). They need the ``[recipes]`` extra;
the library (``hf_posenc.core`` and the three axes) never imports them.
"""
