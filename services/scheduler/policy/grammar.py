"""Constrained decoding in the engine: compile off the engine thread, mask logits, advance matchers.

A request with a constraint waits in ``GrammarManager`` (not in the scheduling queue, so it
holds no request slot and no KV) while a worker thread compiles its grammar; compiled
grammars sit in a bounded LRU cache keyed by (kind, text), and identical constraints in
flight share one compile. The worker also takes the grammar's first step (its first mask,
its first token, the mask after it), where the grammar engines build most of their lazy
state, so a grammar that fails there (an engine limit) is refused at admission. A request
whose grammar fails to compile or at that first step, or is not ready within
``compile_timeout_s``, ends with FINISH_ABORT / INVALID_ARGUMENT naming the request field.

Per step, ``apply_grammar_masks`` sets the logits of disallowed tokens to -inf on the rows
that have a matcher (others untouched; the logits are changed in place), before any
sampling filter (as SGLang and vLLM do); ``accept_grammar_tokens`` advances each matcher by
the token just appended and ends the request with STOP when its grammar has ended. A
grammar is never trusted blindly: after every mask and every token the matcher's error
state is checked, and a mask that allows nothing is an error too, so a grammar that fails
mid-output ends its own request with FINISH_ABORT / INVALID_ARGUMENT (the other rows go
on) instead of failing open or sampling from nothing.

EOS and the request's stop token ids are allowed only where the grammar may end, and
there they end the output; elsewhere a stop id is an ordinary token that the grammar
allows or masks (``Req.stop_ids_end_output``), so a stop id never cuts a structured output.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.scheduler.policy.grammar_backends import GrammarBackend, GrammarError, GrammarSpec, Matcher
from services.scheduler.policy.req import FinishReason, FinishType, Req

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: Req
    spec: GrammarSpec
    future: Future
    deadline: float


class GrammarManager:
    """Compiles constraints in a worker thread and hands requests back with their matcher.

    Args:
        load_backend: makes the backend (reads the tokenizer; run in the worker thread on
            first use, or at start-up through ``warm``).
        compile_timeout_s: a request waits at most this long for its grammar.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, load_backend: Callable[[], GrammarBackend], compile_timeout_s: float = 5.0,
                 cache_size: int = 256):
        self._load_backend = load_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pending: dict[str, _Pending] = {}  # rid -> request waiting for its grammar
        self.wake: Callable[[], None] = lambda: None  # set by the engine loop: a compile finished
        self.observe_compile: Callable[[float], None] = lambda seconds: None  # metrics (worker thread)

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._load_backend()
            return self._backend

    def warm(self) -> None:
        """Load the backend in the worker thread now, so the first constrained request does not wait for it."""
        self._executor.submit(lambda: self.backend)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, req: Req, spec: GrammarSpec) -> None:
        """Hold ``req`` until its grammar is compiled (from the cache when it is there)."""
        future = self._cache.get(spec.key)
        if future is None:
            future = self._executor.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec.key)
        future.add_done_callback(lambda _: self.wake())
        self._pending[req.rid] = _Pending(req, spec, future, time.monotonic() + self.compile_timeout_s)

    def _compile(self, spec: GrammarSpec):
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(spec)
            check_first_step(self.backend, compiled)
            return compiled
        finally:
            self.observe_compile(time.perf_counter() - started)

    def remove(self, req: Req) -> bool:
        """Forget a waiting request (abort); True when it was waiting here."""
        return self._pending.pop(req.rid, None) is not None

    def clear(self) -> None:
        self._pending.clear()

    def take_ready(self) -> tuple[list[Req], list[tuple[Req, str, str]]]:
        """(requests whose matcher is set, (request, error message, gRPC status) of those that failed)."""
        ready: list[Req] = []
        failed: list[tuple[Req, str, str]] = []
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            if p.future.done():
                del self._pending[rid]
                exc = p.future.exception()
                if exc is None:
                    p.req.grammar = self.backend.matcher(p.future.result())
                    ready.append(p.req)
                elif isinstance(exc, GrammarError):
                    failed.append((p.req, f"{p.spec.param}: the constraint cannot be used: {exc}", "INVALID_ARGUMENT"))
                else:
                    log.error("grammar compile failed: %r", exc)
                    failed.append((p.req, f"{p.spec.param}: compiling the constraint failed: {exc!r}", "INTERNAL"))
            elif now >= p.deadline:
                del self._pending[rid]
                failed.append((p.req, f"{p.spec.param}: the constraint did not compile within "
                                      f"{self.compile_timeout_s:g} s (--grammar-compile-timeout); simplify it",
                               "INVALID_ARGUMENT"))
        return ready, failed



def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _allowed_ids(row: torch.Tensor) -> torch.Tensor:
    """The token ids whose bit is set in one bitmask row (int32 [W]), ascending."""
    bits = (row.view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [4W, 8], little-endian
    return bits.reshape(-1).nonzero().flatten()


def _allow(bitmask: torch.Tensor, row: int, tokens) -> None:
    """Set the bits of ``tokens`` in ``bitmask[row]`` (bit j of word w = token 32w + j)."""
    view = bitmask[row].view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    for t in tokens:
        if 0 <= t < 8 * view.numel():
            view[t // 8] |= 1 << (t % 8)


def check_first_step(backend: GrammarBackend, compiled) -> None:
    """Take a compiled grammar's first step on a throwaway matcher: its first mask, its lowest
    allowed token other than EOS (EOS when nothing else is), the mask after it. Runs in the
    compile thread; this is where the engines build most of their lazy state (llguidance's
    Earley rows and lexer states), so its limits show here.

    Raises:
        GrammarError: the matcher's error state, or a mask that allows no token at all.
    """
    matcher = backend.matcher(compiled)
    bitmask = torch.zeros((1, _words(backend.vocab_size)), dtype=torch.int32)
    for step in ("its first mask", "its first token"):
        matcher.fill_bitmask(bitmask, 0)
        error = _mask_error(matcher, bitmask[0])
        if error is not None:
            raise GrammarError(f"the grammar fails at {step}: {error}")
        if matcher.ended or step == "its first token":
            return
        allowed = _allowed_ids(bitmask[0]).tolist()
        token = next((t for t in allowed if t not in backend.eos_ids), allowed[0])
        if not matcher.accept_token(token):
            why = matcher.error or "it rejected an allowed token"
            raise GrammarError(f"the grammar fails at its first token: {why}")
        bitmask.zero_()


def _mask_error(matcher: Matcher, row: torch.Tensor) -> str | None:
    error = matcher.error
    if error is None and not bool(row.any()):
        error = "no token is allowed"
    return error


def _failure(req: Req, error: str, position: int) -> str:
    """The client's message for a grammar that failed at output token ``position`` (1-based)."""
    return (f"{req.grammar_param}: the grammar engine failed at output token {position}: {error}; "
            "simplify the constraint")


# Byte value -> the additive mask of its 8 tokens (0 allowed, -inf not): one gather turns a
# bitmask into a float mask, and one add applies it (measured on one core at 32 rows x 49,152
# tokens: gather 0.5 ms + add 0.2 ms, where bit shifts + torch.where took 1.0 + 5.5 ms).
_BYTE_MASKS: dict[torch.device, torch.Tensor] = {}


def _byte_masks(device: torch.device) -> torch.Tensor:
    """float32 [256, 8] on ``device``; row b, column j is 0 when bit j of b is set, else -inf."""
    table = _BYTE_MASKS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _BYTE_MASKS[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return table


def _allow_extras(req: Req, bitmask: torch.Tensor, row: int) -> None:
    """Beside the grammar's tokens: the reasoning's opening tag (``Req.gate``), and the stop
    token ids where the grammar may end."""
    extra = [req.gate.extra_token] if req.gate.extra_token is not None else []
    if req.sampling.stop_token_ids and req.grammar.may_end:
        extra += req.sampling.stop_token_ids
    _allow(bitmask, row, extra)


@torch.inference_mode()  # the logits come from the forward pass as inference tensors
def apply_grammar_masks(logits: torch.Tensor, reqs: list[Req],
                        to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        skip: Collection[Req] = ()) -> list[tuple[Req, str]]:
    """Disallowed tokens -> -inf, in place, on the rows of ``reqs`` whose grammar masks this
    position (``Req.gate``); other rows untouched.

    Args:
        logits: float32 [B, V], row i belongs to reqs[i].
        to_device: the step's host-to-device copy (``DeviceRuntime.to_device``: pinned and
            non-blocking on CUDA); default a plain ``.to(logits.device)``.
        skip: rows masked already (speculative decoding's drafted rows: ``draft_masks``).
    Returns:
        (request, error message) of each row whose grammar failed here (its error state, or
        a mask that allows nothing): the caller ends those requests; their rows are left
        unmasked. The engines fill an int32 bitmask [R, ceil(V/32)] on the host (bit j of
        word w = token 32w + j, as xgrammar and llguidance both lay it out); it is the only
        host-to-device copy here.
    """
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.gate.masks and r not in skip]
    if not rows:
        return []
    vocab = logits.shape[-1]
    bitmask = torch.zeros((len(rows), _words(vocab)), dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill_bitmask(bitmask, j)
    empty = (~bitmask.any(dim=1)).tolist()  # one check for every row
    failed = []
    for j, i in enumerate(rows):
        req = reqs[i]
        error = req.grammar.error or ("no token is allowed" if empty[j] else None)
        if error is not None:
            bitmask[j] = -1  # the row is sampled and dropped: never from an empty distribution
            failed.append((req, _failure(req, error, len(req.output_ids) + 1)))
        elif req.gate.extra_token is not None or req.sampling.stop_token_ids:
            _allow_extras(req, bitmask, j)
    add_bitmask(logits, rows, bitmask, to_device)
    return failed


@torch.inference_mode()
def add_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
                to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Disallowed tokens -> -inf, in place, on ``logits[rows]``: float32 [B, V] on the device;
    ``bitmask`` int32 [len(rows), ceil(V/32)] on the host (bit j of word w = token 32w + j)."""
    device = logits.device
    copy = to_device or (lambda t: t.to(device))
    byte_ids = copy(bitmask.view(torch.uint8).reshape(-1)).long()  # little-endian words
    add = _byte_masks(device).index_select(0, byte_ids).reshape(len(rows), -1).narrow(1, 0, logits.shape[-1])
    if rows == list(range(logits.shape[0])):
        logits.add_(add)
    else:
        logits.index_add_(0, copy(torch.tensor(rows, dtype=torch.int64)), add)


def draft_masks(req: Req, drafts: list[int], vocab: int) -> tuple[int, torch.Tensor | None]:
    """Speculative decoding under a grammar: walk ``req``'s matcher over its drafts, keeping
    the leading ones the grammar allows (not one that ends it), with the mask at each
    position, then roll the matcher back to where it was.

    Returns:
        (n, bitmask int32 [n + 1, ceil(vocab/32)]: the masks of the position after the newest
        token and after each of the n drafts kept, the request's stop ids allowed where the
        grammar may end); (0, None) when a mask fails (an error, nothing allowed): the row
        then decodes one token, and the ordinary mask reports the failure.
    """
    g = req.grammar
    assert g is not None
    bitmask = torch.zeros((len(drafts) + 1, _words(vocab)), dtype=torch.int32)
    n = 0  # drafts the matcher has taken
    ok = True
    while True:
        g.fill_bitmask(bitmask, n)
        if g.error is not None or not bitmask[n].any():
            ok = False
            break
        if req.sampling.stop_token_ids:
            _allow_extras(req, bitmask, n)
        if n == len(drafts):
            break
        d = drafts[n]
        if not (0 <= d < vocab and (int(bitmask[n, d // 32]) >> (d % 32)) & 1):
            break  # the grammar refuses it: the drafts end before it
        if not g.accept_token(d):
            ok = False
            break
        if g.ended:  # a draft that ends the grammar is left to an ordinary step
            g.rollback(1)
            break
        n += 1
    if n:
        g.rollback(n)
    return (n, bitmask[: n + 1]) if ok and n else (0, None)


def accept_grammar_tokens(reqs: list[Req]) -> None:
    """Advance each grammar by its request's newest token (after stop checks), through its
    gate (``Req.gate``: the reasoning and its tags are not grammar input).

    A request whose grammar has ended finishes with STOP (also when the same token reached
    max_new_tokens: the output is complete). A request that a stop ended is left as it is
    (a stop id is sampled only where the grammar may end, and is no grammar text). A token
    the grammar does not take, or an error state after it, ends the request with
    FINISH_ABORT / INVALID_ARGUMENT naming the constraint.
    """
    for req in reqs:
        g = req.grammar
        if g is None or req.finished and req.finish_reason.type != FinishType.LENGTH:
            continue
        if not req.gate.advance(req.output_ids):
            continue
        if not g.accept_token(req.output_ids[-1]) or g.error is not None:
            error = _failure(req, g.error or "it rejected the sampled token", len(req.output_ids))
            req.finish_reason = FinishReason(FinishType.ABORT, message=error, status="INVALID_ARGUMENT")
        elif g.ended and (req.finish_reason is None or req.finish_reason.type == FinishType.LENGTH):
            req.finish_reason = FinishReason(FinishType.STOP)
