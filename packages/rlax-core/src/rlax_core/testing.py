"""Test helpers shared by the component packages' tests (not used at run time)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["LoopThread"]


class LoopThread:
    """Calls `step()` over and over in a thread until `stop()`, keeping what it raised
    (`error`) for the test to surface: drives one component's loop from one thread."""

    def __init__(self, step: Callable[[], object]) -> None:
        self.step = step
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step()
        except BaseException as error:  # surfaced by the test
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise AssertionError("the loop thread did not stop within 30 s")
