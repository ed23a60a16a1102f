"""Integrations with evaluation tools. Each module imports its tool lazily or only when imported.

- :mod:`hf_posenc.recipes.integrations.lm_eval_model` registers the lm-eval model ``hf-posenc``
  (importing it imports lm-eval);
- :mod:`hf_posenc.recipes.integrations.lm_eval_tasks` holds the benchmark presets and writes lm-eval
  task configs that run the packaged task definitions on hub or local data.
"""
