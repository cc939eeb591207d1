"""Drives an Engine in its own thread.

torch compute blocks, so the engine cannot share the asyncio event loop. Commands come in
through a thread-safe queue and are applied between steps (an abort frees memory before
the next plan is made); step outputs go out through a callback that must not block. An
idle thread sleeps on an event rather than spinning.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from services.scheduler.engine.engine import Engine, LoadStats
from services.scheduler.engine.output import StepOutput
from services.scheduler.engine.req import ReqInput

log = logging.getLogger(__name__)


class EngineLoop:
    """Thread-safe front of an Engine: ``submit``, ``abort``, ``load``; ``start``/``stop`` the thread."""

    def __init__(self, engine: Engine, on_output: Callable[[StepOutput], None]):
        self.engine = engine
        self._on_output = on_output
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the current step; returns when the thread has exited (or after timeout_s)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, spec: ReqInput) -> None:
        self._post(lambda: self.engine.add_request(spec))

    def abort(self, rid: str | None = None, tokenizer_id: str | None = None,
              message: str = "aborted", status: str = "CANCELLED", resend_init: bool = False) -> None:
        """See ``Engine.abort``; applied before the next step."""
        self._post(lambda: self.engine.abort(rid, tokenizer_id, message, status, resend_init))

    def load(self) -> LoadStats:
        return self.engine.load()

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _run(self) -> None:
        while not self._stopping:
            self._drain()
            if not self.engine.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                out = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting every in-flight request")
                self.engine.fail_all("engine step failed; see the scheduler log")
                out = self.engine.step()
            if out is not None:
                self._on_output(out)
