"""Drives an Engine in its own thread.

torch compute blocks, so the engine cannot share the asyncio event loop. Commands come in
through a thread-safe queue and are applied between steps (an abort frees memory before
the next plan is made); step outputs go out through a callback that must not block. An
idle thread sleeps on an event rather than spinning.

Admission happens in the engine thread, where the queue length is exact: with
``max_queued_requests`` set, a request that would make more than that many requests wait
for a free request slot is refused at once (a FINISH_ABORT row with status
RESOURCE_EXHAUSTED, which the gateway answers with 429). The token budget
``max_queued_tokens`` refuses the same way a request whose prompt tokens, added to the
prompt tokens of every request the scheduler holds (waiting and running), would exceed
it; a scheduler that holds nothing admits any request (its size is bounded by the
context length), so a budget below one prompt can never lock a request out forever. ``drain()`` refuses every new
request (UNAVAILABLE) while the ones in flight finish, for a graceful shutdown.
``stalled_s()`` feeds the service's watchdog: how long the thread has had work and not
come back from a step.

Under tensor parallelism the idle thread wakes every ``heartbeat_s`` to run ``heartbeat``
(the other ranks' collectives time out otherwise), and a step that fails because a rank is
gone (``RankFailure``) ends every request with UNAVAILABLE, refuses new ones and calls
``on_fatal``: the group cannot serve again without a restart.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from services.scheduler.engine.engine import Engine
from services.scheduler.engine.step_state import LoadStats
from services.scheduler.executor import step_threads
from services.scheduler.layers.parallel import RankFailure
from services.scheduler.policy.output import StepOutput
from services.scheduler.policy.req import ReqInput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Thread-safe front of an Engine: ``submit``, ``abort``, ``load``; ``start``/``stop`` the thread.

    Args:
        max_queued_requests: requests allowed to wait beyond the free request slots;
            None = no limit.
        max_queued_tokens: prompt tokens (held requests' plus the new one's) admitted at
            most; None = no limit.
        torch_threads: torch's intra-op thread count, set in the engine thread when it
            starts (OpenMP keeps the count per thread), less for small steps where that
            is safe (``executor.step_threads``); None leaves it as it is.
        heartbeat: run in the engine thread after ``heartbeat_s`` idle seconds (tensor
            parallelism: ``TPGroup.heartbeat``); None = sleep until woken.
        on_fatal: called (engine thread) with the reason when a rank of the group is lost.
    """

    def __init__(self, engine: Engine, on_output: Callable[[StepOutput], None],
                 max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 torch_threads: int | None = None, heartbeat: Callable[[], None] | None = None,
                 heartbeat_s: float = 5.0, on_fatal: Callable[[str], None] | None = None):
        self.engine = engine
        self.heartbeat = heartbeat
        self.heartbeat_s = heartbeat_s
        self.on_fatal = on_fatal
        self.torch_threads = torch_threads
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._on_output = on_output
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._draining = False
        self._busy = False  # has work: a step is due or running
        self._beat = time.monotonic()  # last time the thread came round its loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        engine.grammars.wake = self._wake.set

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the current step; returns when the thread has exited (or after timeout_s)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def drain(self) -> None:
        """Refuse every request submitted from now on (UNAVAILABLE); in-flight ones go on."""
        self._draining = True

    @property
    def idle(self) -> bool:
        """No request is held (waiting or running) and no command is pending."""
        return not self.engine.has_work and self._inbox.empty()

    def stalled_s(self) -> float:
        """Seconds the thread has had work pending without finishing a step (0 when idle)."""
        return time.monotonic() - self._beat if self._busy else 0.0

    def submit(self, spec: ReqInput) -> None:
        self._post(lambda: self._admit(spec))

    def refuse(self, spec: ReqInput, message: str, status: str) -> None:
        """Answer ``spec`` with a final FINISH_ABORT row without queueing it."""
        self._post(lambda: self.engine.refuse(spec, message, status))

    def abort(self, rid: str | None = None, tokenizer_id: str | None = None,
              message: str = "aborted", status: str = "CANCELLED", resend_init: bool = False) -> None:
        """See ``Engine.abort``; applied before the next step."""
        self._post(lambda: self.engine.abort(rid, tokenizer_id, message, status, resend_init))

    def load(self) -> LoadStats:
        return self.engine.load()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the engine thread between steps; its result (or exception) in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._post(run)
        return future

    def _admit(self, spec: ReqInput) -> None:
        if self._draining:
            self.engine.refuse(spec, "the scheduler is shutting down", "UNAVAILABLE")
            return
        limit = self.max_queued_requests
        if limit is not None:
            load = self.engine.load()
            free_slots = max(0, self.engine.cfg.max_running_requests - load.num_running_reqs)
            if load.num_waiting_reqs >= limit + free_slots:
                self.engine.refuse(
                    spec,
                    f"the server is overloaded: {load.num_waiting_reqs} requests are already waiting "
                    f"(--max-queued-requests {limit}); retry later",
                    "RESOURCE_EXHAUSTED",
                )
                return
        budget = self.max_queued_tokens
        if budget is not None and self.engine.reqs:
            held = sum(req.prompt_len for req in self.engine.reqs.values())
            if held + len(spec.input_ids) > budget:
                self.engine.refuse(
                    spec,
                    f"the server is overloaded: {held} prompt tokens are already held and this request "
                    f"has {len(spec.input_ids)} (--max-queued-tokens {budget}); retry later",
                    "RESOURCE_EXHAUSTED",
                )
                return
        self.engine.add_request(spec)

    def _post(self, command: Callable[[], object]) -> None:
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
        if self.torch_threads:
            step_threads.install(self.engine.runner, self.torch_threads)
        while not self._stopping:
            self._beat = time.monotonic()
            self._drain()
            if not self.engine.has_work:
                self._busy = False
                heartbeat = self.heartbeat
                woken = self._wake.wait(self.heartbeat_s if heartbeat else None)
                self._wake.clear()
                if not woken and heartbeat is not None and not self._stopping:
                    self._guard(heartbeat)
                continue
            self._busy = True
            try:
                out = self.engine.step()
            except RankFailure as exc:
                self._lost_rank(exc)
                continue
            except Exception:
                log.exception("engine step failed; aborting every in-flight request")
                self.engine.fail_all("engine step failed; see the scheduler log")
                out = self.engine.step()
            if out is not None:
                self._on_output(out)
            elif self.engine.only_compiling:
                # Nothing to run until a grammar compiles (its callback wakes us) or a compile
                # budget runs out (the timeout): sleep rather than spin.
                self._wake.wait(0.05)
                self._wake.clear()

    def _guard(self, collective: Callable[[], None]) -> None:
        try:
            collective()
        except RankFailure as exc:
            self._lost_rank(exc)

    def _lost_rank(self, exc: RankFailure) -> None:
        """A rank of the tensor-parallel group is gone: end everything with UNAVAILABLE, refuse the rest."""
        log.error("tensor-parallel group lost a rank: %s", exc)
        self._draining = True
        self.heartbeat = None
        self.engine.fail_all("a tensor-parallel rank of this replica failed", "UNAVAILABLE")
        out = self.engine.step()  # no plan: only the abort rows
        if out is not None:
            self._on_output(out)
        if self.on_fatal is not None:
            self.on_fatal(str(exc))
