"""The engine: schedule -> run the model on the plan -> process results -> one step output.

Plain Python over torch; knows nothing of gRPC. Not thread-safe: one thread drives it
(see ``engine.loop.EngineLoop``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.scheduler.config import EngineConfig
from services.scheduler.engine.grammar import GrammarManager, accept_grammar_tokens, apply_grammar_masks
from services.scheduler.engine.grammar_backends import GrammarBackend, load_backend
from services.scheduler.engine.kv_pool import ReqToTokenPool, TokenToKVPool, kv_bytes_per_token, kv_pool_tokens
from services.scheduler.engine.model_runner import ModelRunner
from services.scheduler.engine.observer import EngineObserver
from services.scheduler.engine.output import StepOutput
from services.scheduler.engine.prompt_logprobs import plan_logprob_rows, score_prompts
from services.scheduler.engine.radix_cache import RadixCache
from services.scheduler.engine.req import FinishReason, FinishType, Req, ReqInput
from services.scheduler.engine.sampling import Sampler
from services.scheduler.engine.schedule import Plan, SchedulePolicy
from services.scheduler.engine.stops import StopChecker, load_eos_ids
from services.scheduler.engine.validate import validate
from services.scheduler.models import load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadStats:
    """A snapshot of the engine's occupancy and counters since start (the wire's LoadReport)."""

    num_running_reqs: int
    num_waiting_reqs: int
    req_slots_used: int
    kv_used_tokens: int  # held by requests (a cached prefix they lock included)
    kv_cached_tokens: int  # held only by the prefix cache: evictable, free for the taking
    kv_total_tokens: int
    num_decode_steps: int
    peak_decode_batch_size: int
    num_aborted_reqs: int
    num_finished_reqs: int


class Engine:
    """Continuous-batching generation over a paged KV cache.

    API: ``add_request``, ``abort``, ``step``, ``has_work``, ``load``.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, eos_ids: frozenset[int], cfg: EngineConfig):
        """The grammar backend (``cfg.grammar_backend``) reads ``cfg.model``/tokenizer.json when
        the first constrained request arrives, in the compile thread."""
        mc = model.config
        self.cfg = cfg
        self.vocab_size = mc.vocab_size
        self.context_length = cfg.context_length or mc.max_position_embeddings
        if self.context_length > mc.max_position_embeddings:
            raise ValueError(f"--context-length {self.context_length} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        self.req_pool = ReqToTokenPool(cfg.max_running_requests, self.context_length)
        kv_dtype = next(model.parameters()).dtype
        bytes_per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, kv_dtype)
        self.max_total_tokens = kv_pool_tokens(bytes_per_token, cfg.max_total_tokens, cfg.kv_cache_gib,
                                               cfg.kv_cache_mem_fraction)
        log.info("KV pool: %d tokens (%.2f GiB of %s)", self.max_total_tokens,
                 self.max_total_tokens * bytes_per_token / 2**30, kv_dtype)
        self.kv_pool = TokenToKVPool(self.max_total_tokens, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                     kv_dtype)
        self.tree = None if cfg.disable_radix_cache else RadixCache(self.kv_pool)
        self.policy = SchedulePolicy(self.req_pool, self.kv_pool, cfg.max_running_requests, cfg.max_prefill_tokens,
                                     cfg.chunked_prefill_size, self.tree, cfg.schedule_policy)
        self.runner = ModelRunner(model, self.req_pool, self.kv_pool)
        self.sampler = Sampler(cfg.seed, eos_ids)
        self.stops = StopChecker(tokenizer, eos_ids, self.context_length)
        self.grammars = GrammarManager(lambda: self._grammar_backend(eos_ids), cfg.grammar_compile_timeout_s)
        self.reqs: dict[str, Req] = {}  # rid -> in-flight request (compiling, waiting or running)
        self._out = StepOutput()
        self.num_decode_steps = 0
        self.peak_decode_batch_size = 0
        self.num_aborted_reqs = 0
        self.num_finished_reqs = 0
        self.observer = EngineObserver()  # metrics hooks (services/scheduler/metrics.py)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        """Load model, tokenizer.json and EOS ids from ``cfg.model``.

        Raises:
            ValueError: unsupported architecture, dtype or attention backend, or no EOS id.
            RuntimeError: an attention backend that cannot run on the model's device.
            FileNotFoundError: missing config.json, tokenizer.json or weights.
        """
        model_dir = Path(cfg.model)
        model = load_model(model_dir, resolve_dtype(cfg.dtype), cfg.load_format, cfg.attention_backend)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        engine = cls(model, tokenizer, load_eos_ids(model_dir, tokenizer), cfg)
        engine.grammars.warm()
        return engine

    def _grammar_backend(self, eos_ids: frozenset[int]) -> GrammarBackend:
        return load_backend(self.cfg.grammar_backend, Path(self.cfg.model), self.vocab_size, eos_ids)

    # ---- inputs -------------------------------------------------------------------
    def add_request(self, spec: ReqInput) -> None:
        """Queue a request. An invalid or duplicate one gets a final FINISH_ABORT row instead."""
        if spec.rid in self.reqs:
            dup = Req(spec)
            dup.init_sent = True  # the detokenizer's state for this rid belongs to the first request
            self._emit_abort(dup, f"rid {spec.rid!r} is already in flight", "ALREADY_EXISTS")
            return
        error = validate(spec, self.vocab_size, self.context_length, self.max_total_tokens)
        req = Req(spec)
        if error is not None:
            self._emit_abort(req, error, "INVALID_ARGUMENT")
            return
        self.reqs[req.rid] = req
        self.observer.on_queued(req)
        if spec.grammar is not None:
            self.grammars.submit(req, spec.grammar)  # joins the queue once compiled
        else:
            self.policy.waiting.append(req)

    def refuse(self, spec: ReqInput, message: str, status: str) -> None:
        """Answer a request that is not admitted (overload, shutdown) with its final FINISH_ABORT row."""
        self._emit_abort(Req(spec), message, status)

    def abort(self, rid: str | None = None, tokenizer_id: str | None = None,
              message: str = "aborted", status: str = "CANCELLED", resend_init: bool = False) -> int:
        """Abort one rid, every rid owned by ``tokenizer_id``, or (neither given) every rid.

        Frees the KV cache and req slot at once, whether the request waits or runs; each
        aborted request gets a final row with FINISH_ABORT (with its RowInit again when
        ``resend_init``, for a detokenizer that lost its state). Unknown rids are ignored:
        the request may have finished already. Returns how many were aborted.
        """
        if rid is not None:
            victims = [self.reqs[rid]] if rid in self.reqs else []
        elif tokenizer_id is not None:
            victims = [r for r in self.reqs.values() if r.tokenizer_id == tokenizer_id]
        else:
            victims = list(self.reqs.values())
        for req in victims:
            req.init_sent = req.init_sent and not resend_init
            if not self.grammars.remove(req):
                self.policy.remove(req)
            del self.reqs[req.rid]
            self._emit_abort(req, message, status)
        return len(victims)

    def fail_all(self, message: str) -> None:
        """After a failed step: abort every request (status INTERNAL) and reset both pools.

        A step can fail after allocating KV rows it had not yet recorded, so the free lists
        are rebuilt rather than trusted.
        """
        for req in list(self.reqs.values()):
            self._emit_abort(req, message, "INTERNAL")
        self.reqs.clear()
        self.grammars.clear()
        self.policy.reset()

    # ---- the loop -----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.reqs) or len(self._out) > 0

    @property
    def only_compiling(self) -> bool:
        """Every request held waits for its grammar: a step has nothing to run."""
        return len(self.reqs) == self.grammars.num_pending and not len(self._out)

    def step(self) -> StepOutput | None:
        """Run one scheduling step; returns its rows, or None when no row was produced."""
        started = time.monotonic()
        if self.grammars.num_pending:
            self._admit_compiled()
        plan = self.policy.schedule()
        if plan is not None:
            scored = plan_logprob_rows(plan)
            logits = self.runner.forward(plan)
            score_prompts(self.runner.model, plan, scored)
            self.observer.on_step(plan, started)
            self.process_results(plan, logits)
        return self._take_output()

    def process_results(self, plan: Plan, logits: torch.Tensor) -> None:
        """Sample, append, check stops, free finished requests and record their rows.

        Args:
            logits: float32 [len(plan.reqs), vocab], from ``self.runner.forward(plan)``.
        """
        for req, n in zip(plan.reqs, plan.extend_lens):
            req.kv_len += n
        reqs = plan.reqs
        partial = self.policy.chunked
        if partial is not None and partial in reqs[: plan.num_extend]:
            # A chunk short of the prompt's end samples nothing.
            i = reqs.index(partial)
            reqs = reqs[:i] + reqs[i + 1 :]
            logits = torch.cat((logits[:i], logits[i + 1 :]))
        if any(r.sampling.max_new_tokens == 0 for r in reqs):
            reqs, logits = self._finish_scored(reqs, logits)
        if not reqs:
            return
        result = self.sampler.sample(apply_grammar_masks(logits, reqs), reqs)
        next_ids = result.next_ids.tolist()
        for req, token in zip(reqs, next_ids):
            req.append_output(token)
        self.stops.check(reqs)
        accept_grammar_tokens(reqs)
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_vals = result.top_vals.tolist() if result.top_vals is not None else None
        for i, req in enumerate(reqs):
            self._out.add_row(req, [next_ids[i]])
            if req.logprob_start_len is not None and len(req.output_ids) == 1:  # its first token
                self._out.add_prompt_logprobs(req)
            if req.return_logprob:
                k = req.top_logprobs_num
                self._out.add_logprobs(logprobs[i], top_ids[i][:k] if k else [], top_vals[i][:k] if k else [])
            if req.finished:
                self._release(req)
        num_decode = len(plan.reqs) - plan.num_extend
        if num_decode:
            self.num_decode_steps += 1
            self.peak_decode_batch_size = max(self.peak_decode_batch_size, num_decode)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; end those whose grammar failed."""
        ready, failed = self.grammars.take_ready()
        self.policy.waiting.extend(ready)
        for req, message, status in failed:
            del self.reqs[req.rid]
            self._emit_abort(req, message, status)

    def _finish_scored(self, reqs: list[Req], logits: torch.Tensor) -> tuple[list[Req], torch.Tensor]:
        """Requests with max_new_tokens 0 (score the prompt only) end here, their prefill
        done, with their prompt logprobs and no token; the rest go on to sampling."""
        keep = [i for i, r in enumerate(reqs) if r.sampling.max_new_tokens > 0]
        for req in reqs:
            if req.sampling.max_new_tokens == 0:
                req.finish_reason = FinishReason(FinishType.LENGTH)
                self._out.add_row(req, [])
                self._out.add_prompt_logprobs(req)
                self._release(req)
        rows = torch.tensor(keep, dtype=torch.int64, device=logits.device)
        return [reqs[i] for i in keep], logits.index_select(0, rows)

    def _release(self, req: Req) -> None:
        self.policy.remove(req)
        del self.reqs[req.rid]
        self.num_finished_reqs += 1
        self.observer.on_finish(req)

    def _emit_abort(self, req: Req, message: str, status: str) -> None:
        req.finish_reason = FinishReason(FinishType.ABORT, message=message, status=status)
        self._out.add_row(req, [])
        self.num_aborted_reqs += 1
        self.observer.on_finish(req)

    def _take_output(self) -> StepOutput | None:
        out, self._out = self._out, StepOutput()
        return out if len(out) else None

    def load(self) -> LoadStats:
        """Counters for GetLoad; safe to call from another thread (reads of ints and lengths)."""
        cached = self.policy.kv_cached
        return LoadStats(
            num_running_reqs=len(self.policy.running) + (self.policy.chunked is not None),
            num_waiting_reqs=len(self.policy.waiting) + self.grammars.num_pending,
            req_slots_used=self.req_pool.used,
            kv_used_tokens=self.kv_pool.used - cached,
            kv_cached_tokens=cached,
            kv_total_tokens=self.kv_pool.size,
            num_decode_steps=self.num_decode_steps,
            peak_decode_batch_size=self.peak_decode_batch_size,
            num_aborted_reqs=self.num_aborted_reqs,
            num_finished_reqs=self.num_finished_reqs,
        )


def resolve_dtype(name: str) -> torch.dtype:
    """``--dtype`` -> torch dtype; "auto" is bfloat16 where the CPU multiplies bf16 natively
    (AMX or AVX-512-BF16: about 4x fp32's matmul speed on these machines), else float32.

    Raises:
        ValueError: a name outside ``DTYPES``.
    """
    if name == "auto":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"unsupported dtype {name!r}; supported: auto, {', '.join(sorted(dtypes))}")
    return dtypes[name]


def cpu_has_bf16() -> bool:
    """True when /proc/cpuinfo lists amx_bf16 or avx512_bf16 (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags
