"""Where the tokenizer's CPU work runs: a short request on the event loop, the rest on worker threads.

Rendering a chat template, tokenizing and detokenizing are synchronous; on the event loop a
large request would hold every other call, gRPC health included, until it is done (a 15 MB
prompt: 12 s). ``Workers`` runs a request's work on a thread pool instead, unless it is small
enough that the hop costs as much as the work.

Threads, not processes (measured on 2 shared cores, SmolLM2, the loop's largest lag while
one request is tokenized; idle loop 3-9 ms): a prompt at the character bound (663,471
characters, 0.45-0.6 s to tokenize) lags the loop 8-15 ms on a thread and 6-11 ms on a
process; 3 MB (4-8 s) 80-280 ms on a thread, 110-170 ms on a process (its ids are pickled
back). transformers' ``encode`` calls the Rust ``encode_batch``, which releases the GIL;
the rest (Jinja rendering, the id lists) is Python, which hands the GIL over every 5 ms
(``sys.getswitchinterval``). A process pool would add a tokenizer per worker and the
pickling, for no lower lag. The threads share one tokenizer (see ``services.tokenizer.prepare``).

Small requests (``work_bytes`` at most ``INLINE_BYTES``) run on the loop: a hop to a worker
and back costs about 0.3 ms, as much as tokenizing ~150 characters, and a request this
small takes at most ~2 ms (measured: a 1,024-character prompt 1.8 ms, a two-message chat
0.7 ms, on the same loaded cores).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

from google.protobuf.message import Message

T = TypeVar("T")
R = TypeVar("R", bound=Message)

INLINE_BYTES = 1024
# Rendering one chat message costs about as much as tokenizing 256 bytes of text
# (measured: 8,191 messages 1.6 s, 663 kB of text 0.5-1.1 s).
MESSAGE_BYTES = 256
# Beyond a few threads only the Rust encode runs in parallel: the Python parts share the GIL.
MAX_DEFAULT_WORKERS = 4


def default_workers() -> int:
    """Worker threads for this machine: its usable cores, at most ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0))))


def work_bytes(req: Message) -> int:
    """A request's size as a cost: its serialized bytes plus ``MESSAGE_BYTES`` per chat message."""
    size = req.ByteSize()
    if "input" in req.DESCRIPTOR.oneofs_by_name and req.WhichOneof("input") == "chat":
        size += MESSAGE_BYTES * len(req.chat.messages)  # type: ignore[attr-defined]
    return size


def thread_pool(workers: int) -> ThreadPoolExecutor:
    """The tokenizer's worker threads (named ``tokenize_N`` in stack dumps)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")


class Workers:
    """Runs synchronous request work off the event loop (see the module docstring).

    Args:
        executor: the worker threads; None runs everything on the loop (unit tests of the
            request life cycle, where no request is large).
    """

    def __init__(self, executor: Executor | None = None):
        self.executor = executor

    async def run(self, fn: Callable[[R], T], req: R) -> T:
        """``fn(req)``: on the loop when ``req`` is small, else on a worker thread.

        A cancelled caller stops waiting at once; the thread finishes the work and its result
        is dropped (nothing is registered before it returns).
        """
        if self.executor is None or work_bytes(req) <= INLINE_BYTES:
            return fn(req)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, req)

    def shutdown(self) -> None:
        """Stop the threads once their current work ends; queued work is dropped."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
