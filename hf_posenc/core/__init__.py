"""The patching library's core: where an encoding, a backend and a family meet.

What ``pip install hf-posenc`` (no extras) needs, beside the three axes (``hf_posenc.encodings``,
``hf_posenc.attention``, ``hf_posenc.models``). Nothing here imports the recipes
(``hf_posenc.recipes``). The path of a request: ``patch`` (the public verbs) -> ``plan`` (the
request turned into parts) -> ``runtime`` (the per-forward context) -> ``attention.forward``.
"""
