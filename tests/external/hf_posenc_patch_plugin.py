"""pytest plugin: patch every transformers model with an hf_posenc encoding right after construction.

Load it into a run of transformers' own test suite (``-p hf_posenc_patch_plugin`` with this
folder on ``PYTHONPATH``); ``run_transformers_suite.py`` does that for you. Nothing happens
unless ``HF_POSENC_ENCODING`` names an encoding, so the same command line gives the baseline.

Environment:

``HF_POSENC_ENCODING``
    encoding name or alias (``rope``, ``alibi``, ...); unset, empty or ``baseline``: no patching.
``HF_POSENC_PARAMS``
    optional JSON object of encoding parameters, passed to ``patch_model`` as keywords.
``HF_POSENC_ON_PATCH_ERROR``
    ``raise`` (default): an error from ``patch_model`` fails the test that built the model.
    ``skip``: the model stays unpatched and the error is counted (terminal summary, junit
    property ``hf_posenc_unpatched``), so failures further on (in classes the engine does
    patch) are not hidden behind a refusal of one class (e.g. a headless ``LlamaModel``).
``HF_POSENC_FROM_PRETRAINED``
    how models built by ``from_pretrained`` get patched:

    ``construct`` (default)
        like every other model: patched when the outermost model's constructor finishes, which
        inside ``from_pretrained`` is before the checkpoint is loaded, so a checkpoint saved from
        a patched model loads its ``posenc.*`` tensors into the encoding.
    ``after``
        not patched while ``from_pretrained`` builds it; when it returns, the model is patched
        the way a user would: from the checkpoint's ``config.posenc`` mapping (then its
        ``posenc.*`` tensors are loaded from the checkpoint), else with ``HF_POSENC_ENCODING``.

Rules:

* Only the outermost model is patched: ``post_init`` of a model built inside another model's
  ``__init__`` (``LlamaModel`` inside ``LlamaForCausalLM``) is skipped; the outer one's
  ``post_init`` (the last line of its ``__init__``) patches the whole model.
* A model already patched (``hf_posenc.patch_info(model)`` is not None) is never patched again.
* Errors raised by ``patch_model`` are not swallowed: a model the engine refuses makes the
  test fail with that error, so the refusal is counted and visible.

The number of models patched is printed in the terminal summary and stored as a junit
``properties`` entry of every test (``hf_posenc_patched``: models patched during that test).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from typing import Any

import pytest

ENV_ENCODING = "HF_POSENC_ENCODING"
ENV_PARAMS = "HF_POSENC_PARAMS"
ENV_FROM_PRETRAINED = "HF_POSENC_FROM_PRETRAINED"
ENV_ON_ERROR = "HF_POSENC_ON_PATCH_ERROR"
BASELINE_NAMES = ("", "baseline", "native", "unpatched")

_state = threading.local()
_counts = {"patched": 0, "skipped_nested": 0, "already": 0, "errors": 0}
#: ``HF_POSENC_ON_PATCH_ERROR=skip``: model class -> first line of the error that left it unpatched
_unpatched: dict[str, str] = {}


def _encoding() -> str | None:
    name = os.environ.get(ENV_ENCODING, "").strip()
    return None if name.lower() in BASELINE_NAMES else name


def _params() -> dict[str, Any]:
    raw = os.environ.get(ENV_PARAMS, "").strip()
    if not raw:
        return {}
    params = json.loads(raw)
    if not isinstance(params, dict):
        raise pytest.UsageError(f"{ENV_PARAMS} must be a JSON object, got {raw!r}")
    return params


def _mode() -> str:
    mode = os.environ.get(ENV_FROM_PRETRAINED, "construct").strip() or "construct"
    if mode not in ("construct", "after"):
        raise pytest.UsageError(f"{ENV_FROM_PRETRAINED} must be 'construct' or 'after', got {mode!r}")
    return mode


def _on_error() -> str:
    value = os.environ.get(ENV_ON_ERROR, "raise").strip() or "raise"
    if value not in ("raise", "skip"):
        raise pytest.UsageError(f"{ENV_ON_ERROR} must be 'raise' or 'skip', got {value!r}")
    return value


def _inside_enclosing_model_init(model: Any, model_base: type) -> bool:
    """True when ``model`` is being built inside the ``__init__`` of another transformers model."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not None and owner is not model and isinstance(owner, model_base):
                return True
        frame = frame.f_back
    return False


def _patch(model: Any, spec: Any = None) -> None:
    import hf_posenc

    if hf_posenc.patch_info(model) is not None:
        _counts["already"] += 1
        return
    try:
        if spec is None:
            hf_posenc.patch_model(model, _encoding(), **_params())
        else:
            hf_posenc.patch_model(model, spec)
    except Exception as error:
        _counts["errors"] += 1
        if _on_error() == "raise":
            raise
        message = (str(error).splitlines() or [""])[0]
        _unpatched.setdefault(type(model).__name__, f"{type(error).__name__}: {message}"[:300])
        _state.test_unpatched = getattr(_state, "test_unpatched", 0) + 1
        return
    _counts["patched"] += 1
    _state.test_patched = getattr(_state, "test_patched", 0) + 1


def _load_posenc_tensors(model: Any, path: Any) -> None:
    """``after`` mode: load the checkpoint's ``posenc.*`` tensors into the re-applied encoding."""
    import torch

    encoding = getattr(model, "posenc", None)
    if encoding is None or path is None or not os.path.isdir(str(path)):
        return
    tensors: dict[str, torch.Tensor] = {}
    for root, _dirs, files in os.walk(str(path)):
        for file in files:
            full = os.path.join(root, file)
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(full, framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118
                        if key.startswith("posenc."):
                            tensors[key[len("posenc.") :]] = f.get_tensor(key)
            elif file.endswith(".bin"):
                state = torch.load(full, map_location="cpu", weights_only=True)
                tensors.update({k[len("posenc.") :]: v for k, v in state.items() if k.startswith("posenc.")})
    if tensors:
        encoding.load_state_dict(tensors, strict=False)


def _install() -> None:
    from transformers import PreTrainedModel

    original_post_init = PreTrainedModel.post_init
    original_from_pretrained = PreTrainedModel.from_pretrained.__func__
    mode = _mode()

    @functools.wraps(original_post_init)
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        if mode == "after" and getattr(_state, "in_from_pretrained", 0):
            return result
        if _inside_enclosing_model_init(self, PreTrainedModel):
            _counts["skipped_nested"] += 1
            return result
        _patch(self)
        return result

    @functools.wraps(original_from_pretrained)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if mode != "after":
            return original_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        _state.in_from_pretrained = getattr(_state, "in_from_pretrained", 0) + 1
        try:
            result = original_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        finally:
            _state.in_from_pretrained -= 1
        if _state.in_from_pretrained:
            return result
        model = result[0] if isinstance(result, tuple) else result
        saved = getattr(model.config, "posenc", None)
        if saved:
            delattr(model.config, "posenc")
            _patch(model, dict(saved))
            _load_posenc_tensors(model, pretrained_model_name_or_path)
        else:
            _patch(model)
        return result

    PreTrainedModel.post_init = post_init
    if mode == "after":
        PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def pytest_configure(config: pytest.Config) -> None:
    name = _encoding()
    config._hf_posenc_encoding = name  # type: ignore[attr-defined]
    if name is None:
        return
    import hf_posenc

    known = {n for info in hf_posenc.list_encodings() for n in (info.name, *info.aliases)}
    if name.lower() not in known:
        raise pytest.UsageError(f"{ENV_ENCODING}={name!r} is not an hf_posenc encoding: {sorted(known)}")
    _params()
    _on_error()
    _install()


def pytest_report_header(config: pytest.Config) -> str:
    name = getattr(config, "_hf_posenc_encoding", None)
    if name is None:
        return "hf_posenc: baseline (no patching)"
    return (
        f"hf_posenc: patching every model with {name!r} params={_params()} "
        f"from_pretrained={_mode()} on_patch_error={_on_error()}"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    _state.test_patched = 0
    _state.test_unpatched = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if call.when == "call" and getattr(item.config, "_hf_posenc_encoding", None) is not None:
        item.user_properties.append(("hf_posenc_patched", getattr(_state, "test_patched", 0)))
        if getattr(_state, "test_unpatched", 0):
            item.user_properties.append(("hf_posenc_unpatched", _state.test_unpatched))
    yield


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    name = getattr(config, "_hf_posenc_encoding", None)
    if name is None:
        terminalreporter.write_line("hf_posenc: baseline run, no model patched")
        return
    terminalreporter.write_line(
        f"hf_posenc: encoding {name!r}: {_counts['patched']} models patched, "
        f"{_counts['errors']} patch errors, {_counts['already']} already patched, "
        f"{_counts['skipped_nested']} nested models left to their outer model"
    )
    for cls, error in sorted(_unpatched.items()):
        terminalreporter.write_line(
            f"hf_posenc: left unpatched (HF_POSENC_ON_PATCH_ERROR=skip): {cls}: {error}"
        )
