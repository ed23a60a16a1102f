"""The extrapolation study (``hf-posenc study``): one base checkpoint, several encodings, one report.

- :mod:`.spec` — what is asked: the settings and the encoding specs (imports nothing of the study)
- :mod:`.runs` — which runs to train, reuse or resume (builds on spec)
- :mod:`.evaluate` — the loss-vs-length evaluation and evaluation-only rows (builds on spec)
- :mod:`.run` — the orchestration: checks, base pretraining, runs, evaluation, report
"""

from .run import check_study, run_study
from .spec import DEFAULT_ENCODINGS, StudyConfig, display_label, load_study_config, parse_encoding_spec

__all__ = [
    "DEFAULT_ENCODINGS",
    "StudyConfig",
    "check_study",
    "display_label",
    "load_study_config",
    "parse_encoding_spec",
    "run_study",
]
