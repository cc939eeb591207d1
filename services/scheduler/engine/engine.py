"""The engine: schedule -> run the model on the plan -> process results -> one step output.

Plain Python over torch; knows nothing of gRPC. Not thread-safe: one thread drives it
(see ``engine.loop.EngineLoop``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ringserve.modelfacts import embedding_facts
from services.scheduler.config import EngineConfig
from services.scheduler.disagg.handoff import DisaggState
from services.scheduler.disagg.roles import Role
from services.scheduler.engine.observer import EngineObserver
from services.scheduler.engine.step_state import InFlight, LoadStats, emitted_run, penalised, reads_output_history
from services.scheduler.executor.build import build_stack, load_engine_model, size_pools
from services.scheduler.executor.device import DeviceRuntime, create_runtime
from services.scheduler.executor.model_runner import FutureIds
from services.scheduler.executor.pooling import accumulate, finish_embeddings, plan_pool_rows, pool_from
from services.scheduler.executor.prompt_logprobs import plan_logprob_rows, score_prompts
from services.scheduler.executor.sampling import Sampler
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.lora.registry import open_registry
from services.scheduler.models.base import CausalLM
from services.scheduler.policy.grammar import GrammarManager, accept_grammar_tokens, apply_grammar_masks
from services.scheduler.policy.grammar_backends import GrammarBackend, load_backend
from services.scheduler.policy.kv_events import KvEventLog
from services.scheduler.policy.output import StepOutput
from services.scheduler.policy.radix_cache import RadixCache
from services.scheduler.policy.req import FinishReason, FinishType, Req, ReqInput
from services.scheduler.policy.schedule import Plan, SchedulePolicy
from services.scheduler.policy.stops import StopChecker, load_eos_ids
from services.scheduler.policy.validate import validate
from services.scheduler.speculative.build import build_speculator

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching generation over a paged KV cache.

    API: ``add_request``, ``abort``, ``step``, ``has_work``, ``load``.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, eos_ids: frozenset[int], cfg: EngineConfig,
                 runtime: DeviceRuntime | None = None):
        """Build the pools, the runner and the rest around ``model`` (``executor.build``). The
        grammar backend (``cfg.grammar_backend``) reads ``cfg.model``/tokenizer.json when
        the first constrained request arrives, in the compile thread.

        A model sharded over a tensor-parallel group (its ``tp``) makes this the group's rank
        0: the KV pool holds this rank's KV heads, the req-to-token writes are recorded for
        the other ranks, and CUDA graphs and overlap scheduling are off (each step is
        broadcast from the host before it runs; see ``executor.tp``)."""
        self.cfg = cfg
        runtime = runtime or create_runtime(next(model.parameters()).device)
        shape, self.memory = size_pools(model, cfg, runtime)
        stack = build_stack(model, cfg, runtime, shape, resolve_deterministic=True)
        self.tp: TensorParallel = stack.tp
        self.runtime = runtime
        self.vocab_size = model.config.vocab_size
        self.context_length = shape.context_length
        self.max_total_tokens = shape.max_total_tokens
        self.deterministic = stack.shape.deterministic
        self.kv_pool, self.req_pool, self.runner = stack.kv_pool, stack.req_pool, stack.runner
        self.lora = open_registry(stack.lora, cfg)  # LoRA adapters (None: off)
        self.kv_events = KvEventLog()  # the prefix cache's page events (policy/kv_events.py)
        self.tree = None if cfg.disable_radix_cache else RadixCache(self.kv_pool, self.kv_events)
        self.policy = SchedulePolicy(self.req_pool, self.kv_pool, cfg.max_running_requests, cfg.max_prefill_tokens,
                                     cfg.chunked_prefill_size, self.tree, cfg.schedule_policy)
        self.sampler = Sampler(self.runtime, cfg.seed, eos_ids)
        self.stops = StopChecker(tokenizer, eos_ids, self.context_length)
        self.grammars = GrammarManager(lambda: self._grammar_backend(eos_ids), cfg.grammar_compile_timeout_s)
        embedding = embedding_facts(Path(cfg.model))
        self.pooling, self.normalize = embedding.resolve(cfg.embedding_pooling, cfg.embedding_normalize)
        # A sentence-transformers pipeline it cannot pool refuses embeddings, unless the flag says how.
        self.embed_refusal = embedding.refusal if cfg.embedding_pooling is None else None
        self.reqs: dict[str, Req] = {}  # rid -> in-flight request (compiling, waiting or running)
        self._out = StepOutput()
        self.num_decode_steps = 0
        self.peak_decode_batch_size = 0
        self.num_aborted_reqs = 0
        self.num_finished_reqs = 0
        self.observer = EngineObserver()  # metrics hooks (services/scheduler/metrics.py)
        # Overlap scheduling: by default where the device runs the forward while the host plans.
        self.overlap = cfg.overlap_schedule if cfg.overlap_schedule is not None else runtime.overlap_default
        self.overlap = self.overlap and self.tp.size == 1  # the other ranks never see the sampled ids
        # Speculative decoding (speculative/): the next plan needs the accepted count, so no overlap.
        self.speculator = build_speculator(cfg, self.sampler, runtime, self.context_length, penalised,
                                           self.vocab_size)
        self.overlap = self.overlap and self.speculator is None
        self._inflight: InFlight | None = None
        self.disagg = DisaggState(self)  # prefill/decode handoffs (services/scheduler/disagg)

    @classmethod
    def from_config(cls, cfg: EngineConfig, tp: TensorParallel | None = None) -> Engine:
        """Load model, tokenizer.json and EOS ids from ``cfg.model`` onto ``cfg.device``
        (rank 0 of ``tp``: its shard, on its device; see ``executor.build.load_engine_model``).

        Raises:
            ValueError: unsupported architecture, device, dtype or attention backend, no EOS
                id, or a model ``tp.size`` does not divide.
            RuntimeError: a CUDA device torch does not see, or an attention backend that
                cannot run on the device.
            FileNotFoundError: missing config.json, tokenizer.json or weights.
        """
        model_dir = Path(cfg.model)
        model, runtime = load_engine_model(cfg, tp)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        engine = cls(model, tokenizer, load_eos_ids(model_dir, tokenizer), cfg, runtime)
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
        error = validate(spec, self.vocab_size, self.context_length, self.max_total_tokens, self.policy.policy)
        if error is None and spec.embed and self.embed_refusal is not None:
            error = f"this model's embeddings cannot be served: {self.embed_refusal} (--embedding-pooling overrides)"
        req = Req(spec)
        if error is not None:
            self._emit_abort(req, error, "INVALID_ARGUMENT")
            return
        if spec.lora_name:
            req.lora = self.lora.acquire(spec.lora_name) if self.lora is not None else None
            if req.lora is None:
                self._emit_abort(req, f"The model '{spec.lora_name}' does not exist", "NOT_FOUND")
                return
        if spec.sampling.seed is not None:
            req.generator = self.sampler.generator_for(spec.sampling.seed)
        if req.embed:
            req.pool_from = pool_from(req, self.pooling)
        self.reqs[req.rid] = req
        self.observer.on_queued(req)
        if spec.grammar is not None:
            self.grammars.submit(req, spec.grammar)  # joins the queue once compiled
        else:
            self._enqueue([req])

    def _enqueue(self, reqs: list[Req]) -> None:
        """Requests join the waiting queue; a decode-side one waits for its reservation instead."""
        for req in reqs:
            if req.disagg_role == Role.DECODE:
                self.disagg.reserve(req)
            else:
                self.policy.waiting.append(req)

    def refuse(self, spec: ReqInput, message: str, status: str) -> None:
        """Answer a request that is not admitted (overload, shutdown) with its final FINISH_ABORT row."""
        self._emit_abort(Req(spec), message, status)

    def abort(self, rid: str | None = None, tokenizer_id: str | None = None,
              message: str = "aborted", status: str = "CANCELLED", resend_init: bool = False) -> int:
        """Abort one rid, every rid owned by ``tokenizer_id``, or (neither given) every rid.
        With both, the rid only if ``tokenizer_id`` owns it (a tokenizer aborts its own).

        Frees the KV cache and req slot at once, whether the request waits or runs; each
        aborted request gets a final row with FINISH_ABORT (with its RowInit again when
        ``resend_init``, for a detokenizer that lost its state). Unknown rids are ignored:
        the request may have finished already. Returns how many were aborted.
        """
        if rid is not None:
            req = self.reqs.get(rid)
            victims = [req] if req is not None and tokenizer_id in (None, req.tokenizer_id) else []
        elif tokenizer_id is not None:
            victims = [r for r in self.reqs.values() if r.tokenizer_id == tokenizer_id]
        else:
            victims = list(self.reqs.values())
        for req in victims:
            req.init_sent = req.init_sent and not resend_init
            if not self.grammars.remove(req) and not self.disagg.remove(req):
                self.policy.remove(req)
            del self.reqs[req.rid]
            if self.speculator is not None:
                self.speculator.forget(req)
            self._emit_abort(req, message, status)
        return len(victims)

    def fail_all(self, message: str, status: str = "INTERNAL") -> None:
        """After a failed step: abort every request (with ``status``) and reset both pools.

        A step can fail after allocating KV rows it had not yet recorded, so the free lists
        are rebuilt rather than trusted.
        """
        for req in list(self.reqs.values()):
            if self.speculator is not None:
                self.speculator.forget(req)
            self._emit_abort(req, message, status)
        self.reqs.clear()
        self._inflight = None
        self.grammars.clear()
        self.disagg.clear()
        self.policy.reset()

    def flush_cache(self) -> bool:
        """Empty the prefix cache and free its KV rows (one batch with a clear); False, and
        nothing done, while any request is held (its rows may be the cache's)."""
        if self.reqs or self._inflight is not None:
            return False
        if self.tree is not None:
            self.tree.reset()
            self.kv_events.seal()
        self.kv_pool.reset()
        return True

    def kv_snapshot(self) -> int:
        """Seal a snapshot batch (a clear, then every page the prefix cache holds); returns its sequence."""
        self.kv_events.seal()  # what this step recorded so far comes first
        if self.tree is not None:
            self.tree.record_snapshot()
        else:
            self.kv_events.cleared()
        sequence = self.kv_events.seal(snapshot=True)
        assert sequence is not None
        return sequence

    # ---- the loop -----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.reqs) or len(self._out) > 0 or self._inflight is not None

    @property
    def only_compiling(self) -> bool:
        """Every request held waits for its grammar (or a prefill/decode handoff): a step has nothing to run."""
        held = self.grammars.num_pending + self.disagg.num_held
        return len(self.reqs) == held and not len(self._out) and self._inflight is None

    def step(self) -> StepOutput | None:
        """Run one scheduling step; returns its rows, or None when no row was produced.

        With overlap scheduling the rows are those of the step before: this step is planned
        and launched first, then the previous step's sampled ids are awaited and processed
        (see the package docstring). A step that admits, chunk-prefills or retracts, or a
        batch holding a request whose sampling reads its own output history (penalties,
        min tokens), first takes the previous step's results, so every plan is the one the
        engine makes without overlap.
        """
        started = time.monotonic()
        if self.grammars.num_pending:
            self._admit_compiled()
        if self.disagg.waiting or self.disagg.reserved or self.disagg.landing:
            self.disagg.poll()
        if self._inflight is not None and not self._can_overlap():
            self._finish(self._inflight)
            self._inflight = None
        inflight, self._inflight = self._inflight, None
        plan = self.policy.schedule(self._ending_by_length(inflight))
        if plan is not None and self.speculator is not None:
            plan = self.speculator.expand(plan, self.policy)
        launched = None
        if plan is not None:
            scored = plan_logprob_rows(plan)
            plan_pool_rows(plan, self.pooling)
            self.disagg.admitted(plan)  # a prefill part's handoff opens while its first chunk computes
            if inflight is None or inflight.next_ids is None:
                logits = self.runner.forward(plan)
            else:
                logits = self.runner.forward(plan, FutureIds(inflight.next_ids, inflight.rows))
            score_prompts(self.runner.model, self.runtime, plan, scored)
            accumulate(plan, self.pooling)
            self.observer.on_step(plan, started)
            launched = self._launch(plan, logits)
            self.disagg.extended(plan)  # a prefill part's finished chunk moves while the next computes
        if inflight is not None:
            self._finish(inflight)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
            else:
                self._finish(launched)
        self.kv_events.seal()
        return self._take_output()

    def _launch(self, plan: Plan, logits: torch.Tensor) -> InFlight | None:
        """Advance the plan's requests' KV lengths, sample on the device and start the copy
        of the sampled ids (and of the embeddings that ended) to the host; None when no row
        samples and no embedding ended."""
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            req.kv_len += n
        num_decode = len(plan.reqs) - plan.num_extend + plan.num_drafted
        verify_logits, masked = None, frozenset[Req]()
        if plan.drafts and self.speculator is not None:  # the rows after the plan's judge its drafts
            verify_logits, logits = logits.narrow(0, len(plan.reqs), logits.shape[0] - len(plan.reqs)), \
                logits.narrow(0, 0, len(plan.reqs))
            masked = self.speculator.apply_masks(plan, logits, verify_logits)  # the drafted rows' grammars
        if num_decode:
            self.num_decode_steps += 1
            self.peak_decode_batch_size = max(self.peak_decode_batch_size, num_decode)
        # A chunk short of the prompt's end samples nothing, nor does a request that only scores
        # or embeds its prompt (it ends here).
        partial = self.policy.chunked
        keep = [i for i, r in enumerate(plan.reqs) if r is not partial and r.sampling.max_new_tokens > 0]
        reqs = [plan.reqs[i] for i in keep]
        ended = [r for r in plan.reqs[: plan.num_extend] if r is not partial and r.sampling.max_new_tokens == 0]
        embedded = [r for r in ended if r.embed]
        for req in ended:
            if not req.embed:
                self._finish_scored(req)
        pooled = None
        if embedded:
            pooled = finish_embeddings(embedded, self.normalize, self.runtime)
            for req in embedded:  # their KV and slot go now; their rows when the copy is in
                self.policy.remove(req)
        if not reqs:
            return InFlight([], None, {}, None, embedded, pooled) if embedded else None
        if len(reqs) < len(plan.reqs):
            logits = logits.index_select(0, self.runtime.to_device(torch.tensor(keep, dtype=torch.int64)))
        failed = apply_grammar_masks(logits, reqs, self.runtime.to_device, masked)
        result = self.sampler.sample(logits, reqs)
        for req, message in failed:  # their rows were sampled unmasked and are dropped in _finish
            self.abort(req.rid, message=message, status="INVALID_ARGUMENT")
        # The step's one device-to-host copy: the sampled ids (and logprobs where asked).
        launched = InFlight(reqs, result.next_ids, {r: i for i, r in enumerate(reqs)},
                            result.start_copy(self.runtime), embedded, pooled)
        if verify_logits is not None and self.speculator is not None:
            launched.verified = self.speculator.verify(plan, verify_logits)
        return launched

    def _finish(self, step: InFlight) -> None:
        """Record the rows of a launched step's embeddings (waiting for their copy); wait for
        its sampled ids; append, check stops, advance grammars, free finished requests and
        record their rows. Rows of requests that ended meanwhile (a stop found in the step
        before, an abort) are dropped."""
        if step.pooled is not None:
            self._finish_embedded(step.embedded, step.pooled())
        if step.wait is None:
            return
        result = step.wait()
        if self.speculator is not None:
            for req, v in step.verified.items():  # rejected drafts' KV rows go back first
                self.speculator.settle(req, v, self.policy)
        live = [(i, r) for i, r in enumerate(step.reqs) if not r.finished and self.reqs.get(r.rid) is r]
        live = self.disagg.take_prefilled(live, result)  # prefill parts: handed over, not decoded here
        runs = {i: emitted_run(result, i, step.verified.get(req)) for i, req in live}
        start = {i: len(req.output_ids) for i, req in live}
        # One token per row at a time, so a stop inside a drafted run ends it there.
        pending, n = live, 0
        while pending:
            for i, req in pending:
                req.append_output(runs[i][n].token)
            self.stops.check([r for _, r in pending])
            accept_grammar_tokens([r for _, r in pending])
            n += 1
            pending = [(i, r) for i, r in pending if not r.finished and n < len(runs[i])]
        for i, req in live:
            run = runs[i][: len(req.output_ids) - start[i]]
            self._out.add_row(req, [t.token for t in run])
            if req.logprob_start_len is not None and start[i] == 0:  # its first token
                self._out.add_prompt_logprobs(req)
            if req.return_logprob:
                k = req.top_logprobs_num
                for t in run:
                    self._out.add_logprobs(t.logprob, t.top_ids[:k] if k else [], t.top_vals[:k] if k else [])
            if req.finished:
                self._release(req)

    def _can_overlap(self) -> bool:
        """The next plan needs nothing the in-flight step's results could change."""
        p = self.policy
        if p.waiting or p.chunked is not None or len(p.running) > p.kv_room:
            return False
        return not any(reads_output_history(r) for r in p.running)

    def _ending_by_length(self, inflight: InFlight | None) -> frozenset[Req]:
        """Requests whose in-flight token is their last by length: not decoded again."""
        if inflight is None:
            return frozenset()
        return frozenset(r for r in inflight.reqs if len(r.output_ids) + 1 >= r.sampling.max_new_tokens
                         or r.seq_len + 1 >= self.context_length or r.disagg_role == Role.PREFILL)

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; end those whose grammar failed."""
        ready, failed = self.grammars.take_ready()
        self._enqueue(ready)
        for req, message, status in failed:
            del self.reqs[req.rid]
            self._emit_abort(req, message, status)

    def _finish_scored(self, req: Req) -> None:
        """A request with max_new_tokens 0 that scores its prompt ends here, its prefill done,
        with its prompt logprobs and no token."""
        req.finish_reason = FinishReason(FinishType.LENGTH)
        self._out.add_row(req, [])
        self._out.add_prompt_logprobs(req)
        self._release(req)

    def _finish_embedded(self, reqs: list[Req], vectors: list[list[float]]) -> None:
        """Embeddings whose prefill ended (KV freed) end with their vector; one aborted meanwhile is skipped."""
        for req, vec in zip(reqs, vectors, strict=True):
            if self.reqs.get(req.rid) is not req:
                continue
            req.finish_reason = FinishReason(FinishType.LENGTH)
            self._out.add_row(req, [])
            self._out.add_embedding(vec)
            self._release(req)

    def _release(self, req: Req) -> None:
        self.policy.remove(req)
        self._release_lora(req)
        if self.speculator is not None:
            self.speculator.forget(req)
        del self.reqs[req.rid]
        self.num_finished_reqs += 1
        self.observer.on_finish(req)

    def _emit_abort(self, req: Req, message: str, status: str) -> None:
        req.finish_reason = FinishReason(FinishType.ABORT, message=message, status=status)
        self._release_lora(req)
        self._out.add_row(req, [])
        self.num_aborted_reqs += 1
        self.observer.on_finish(req)

    def _release_lora(self, req: Req) -> None:
        """An ended request lets go of its adapter (after its KV went to the prefix cache under its namespace)."""
        if req.lora is not None and self.lora is not None:
            self.lora.release(req.lora)
            req.lora = None

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
            schedule_policy=self.policy.policy,
            num_transfer_reqs=len(self.disagg.reserved),
            num_waiting_prompt_tokens=self.policy.waiting.tokens,
        )
