"""Ctrl-C during training: finish the step in progress, save a checkpoint, then stop.

A second Ctrl-C stops at once (the previous checkpoint stays the resume point)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class StopRequest:
    """Context manager: while active, the first SIGINT only sets ``requested``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous: signal.Handlers | int | Callable[[int, FrameType | None], Any] | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\n[train] Ctrl-C: saving a checkpoint after this step (Ctrl-C again to stop at once)", flush=True
        )

    def __enter__(self) -> StopRequest:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)
