"""Exceptions raised by hf_posenc. Every message names the bad value and what is allowed."""

from __future__ import annotations


class PosencError(Exception):
    """Base class of every error raised by hf_posenc."""


class UnknownEncodingError(PosencError, ValueError):
    """The encoding name is not registered."""


class InvalidParameterError(PosencError, ValueError):
    """An encoding parameter is unknown, has the wrong type, or is out of range."""


class UnsupportedModelError(PosencError, ValueError):
    """The model family (``config.model_type``) or its shape is not supported."""


class AlreadyPatchedError(PosencError, RuntimeError):
    """``patch_model`` was called on a model that is already patched."""


class NotPatchedError(PosencError, RuntimeError):
    """``unpatch_model`` was called on a model that is not patched."""


class PositionRangeError(PosencError, ValueError):
    """An input position lies outside what the encoding can represent (e.g. a learned table)."""


class CheckpointError(PosencError, ValueError):
    """A checkpoint does not hold what was asked of it: no ``posenc`` entry, another encoding than
    the one requested, or missing encoding tensors."""
