"""Report labels for a model evaluated with encoding parameters changed at evaluation time.

A table row measured on a trained checkpoint whose encoding was reconfigured only for the
evaluation (e.g. ExPE trained unscaled, evaluated with its positions divided by 2, the ExPE
paper's "scaled by 0.5", Table 3) must say so, or it reads as a trained model. Linear position
interpolation by ``factor`` f shows as the multiplier the positions get (``x0.5`` for f = 2);
anything else shows as ``key=value``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def run_name(path: str) -> str:
    """The name a report row is known by: the folder's, or for a run's ``final``/``checkpoint-N``
    folder the run's (``runs/alibi/final`` -> ``alibi``, ``runs/alibi/checkpoint-200`` ->
    ``alibi/checkpoint-200``); a hub id keeps its last part."""
    folder = Path(os.path.expanduser(str(path).rstrip("/") or "/"))
    if folder.name in ("", ".", "..") or (folder.parent.name in ("", ".", "..") and os.path.isdir(folder)):
        folder = folder.resolve()
    if folder.name == "final" and folder.parent.name:
        return folder.parent.name
    if folder.name.startswith("checkpoint-") and folder.parent.name:
        return f"{folder.parent.name}/{folder.name}"
    return folder.name or str(path)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _scaling_text(scaling: Any) -> str:
    if not isinstance(scaling, Mapping):
        return f"scaling={_compact(scaling)}"
    kind, factor = scaling.get("type"), scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        return f"scaling={_compact(dict(scaling))}"
    if kind == "linear" and len(scaling) == 2:
        return f"x{1 / factor:.3g}"
    rest = {k: v for k, v in scaling.items() if k not in ("type", "factor")}
    return f"{kind} x{factor:g}" + (f" {_compact(rest)}" if rest else "")


def eval_override_text(overrides: Mapping[str, Any] | None) -> str:
    """``"x0.5 at eval"`` for ``{"scaling": {"type": "linear", "factor": 2}}``; ``""`` for none."""
    if not overrides:
        return ""
    parts = []
    for key in sorted(overrides):
        value = overrides[key]
        parts.append(_scaling_text(value) if key == "scaling" else f"{key}={_compact(value)}")
    return ", ".join(parts) + " at eval"


def encoding_label(encoding: str, overrides: Mapping[str, Any] | None = None) -> str:
    """``"expe"``, or ``"expe, x0.5 at eval"`` when parameters were overridden for the evaluation."""
    text = eval_override_text(overrides)
    return f"{encoding}, {text}" if text else encoding
