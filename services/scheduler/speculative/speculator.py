"""The speculative step: which decoding rows carry drafts, their KV rows, and what each keeps.

``expand`` turns a plan's decode rows that got drafts into extend rows of ``1 + k`` tokens
(placed after the plan's prompt extends: the model runner runs one extend part and one
decode part) with ``k`` more KV rows each, so verification is one forward over the paged KV
cache beside the rows without drafts. After the forward, ``verify`` judges the drafts
(``speculative.verify``), and ``settle`` gives back the KV rows of the rejected drafts at
once: a request's ``kv_len`` never counts a row past its accepted tokens, and the pool's
accounting is what it would be without speculation.

Who drafts: a decoding request whose logits depend on its own output (penalties, min tokens
not reached: the engine's ``penalised``, passed as ``one_at_a_time``) decodes one token at a
time. Under a grammar (once its reasoning gate, if any, is past) each draft is checked
against the matcher before it is verified -- the drafts end at the first one the grammar
refuses -- and every verification position gets the grammar's mask there
(``policy.grammar.draft_masks``; the matcher is rolled back after the walk and advanced by
the engine over the tokens kept), so a kept or replacement token is always one the grammar
allows. The draft length is bounded by ``max_new_tokens`` and the context
(no draft is verified past the last token the request may emit), by the KV rows free after
the plan, and by the request's recent acceptance (``Backoff``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import Sampler
from services.scheduler.policy.grammar import add_bitmask, draft_masks
from services.scheduler.policy.grammar_gate import ACTIVE
from services.scheduler.policy.req import Req
from services.scheduler.policy.schedule import Plan, SchedulePolicy
from services.scheduler.speculative.proposer import Proposer
from services.scheduler.speculative.verify import accepted_run, verify

# A row whose drafts were all rejected this many times in a row pauses drafting, for twice as
# many steps each time again (up to MAX_PAUSE): text the proposer cannot predict costs little.
MAX_PAUSE = 64


@dataclass
class Backoff:
    """A request's adaptive draft length: after a try that keeps every draft, twice as many;
    otherwise one more than the run kept (up to the maximum either way); a try that keeps
    nothing pauses drafting, each pause in a row twice as long."""

    limit: int
    pause: int = 0  # steps left without drafts
    next_pause: int = 1

    def record(self, proposed: int, kept: int, most: int) -> None:
        self.limit = min(most, 2 * kept if kept == proposed else kept + 1)
        if kept == 0 and proposed:
            self.pause, self.next_pause = self.next_pause, min(MAX_PAUSE, 2 * self.next_pause)
        elif kept:
            self.next_pause = 1


@dataclass
class Verified:
    """A drafted row after the forward: its drafts and, once read back, each position's
    (accepted, token, logprob, top ids, top values) (``Verdicts.to_host``)."""

    drafts: list[int]
    positions: list[tuple[bool, int, float | None, list[int], list[float]]] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return accepted_run([p[0] for p in self.positions])


@dataclass
class SpecStats:
    """Counters since start (the scheduler's /metrics)."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of them, kept
    verify_rows: int = 0  # drafted rows verified (each emits kept + 1 tokens)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a drafted row emits per step (1 + accepted drafts)."""
        return (self.verify_rows + self.accepted) / self.verify_rows if self.verify_rows else 0.0


class Speculator:
    """Plans, verifies and settles the drafted rows of each step (module docstring).

    Args:
        proposer: where drafts come from (``speculative.proposer``).
        num_draft_tokens: most drafts per row and step.
        context_length: no draft is placed at or past this position.
        one_at_a_time: requests never given drafts.
        vocab_size: the logits' width (grammar masks).
    """

    def __init__(self, proposer: Proposer, sampler: Sampler, runtime: DeviceRuntime, num_draft_tokens: int,
                 context_length: int, one_at_a_time: Callable[[Req], bool], vocab_size: int):
        self.proposer = proposer
        self.vocab_size = vocab_size
        self._masks: dict[Req, torch.Tensor] = {}  # this step's drafted rows under a grammar
        self.one_at_a_time = one_at_a_time
        self.sampler = sampler
        self.runtime = runtime
        self.num_draft_tokens = num_draft_tokens
        self.context_length = context_length
        self.backoff: dict[Req, Backoff] = {}
        self.stats = SpecStats()

    def _limit(self, req: Req) -> int:
        if self.one_at_a_time(req) or req.grammar is not None and req.gate.state != ACTIVE:
            return 0
        b = self.backoff.setdefault(req, Backoff(self.num_draft_tokens))
        if b.pause:
            b.pause -= 1
            return 0
        # The bonus token is the last one that may be emitted: no draft past it.
        left = min(req.sampling.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len) - 1
        return max(0, min(b.limit, left))

    def expand(self, plan: Plan, policy: SchedulePolicy) -> Plan:
        """The plan with drafts on the decode rows that get some (the same plan when none does)."""
        ne = plan.num_extend
        decode = plan.reqs[ne:]
        if not decode:
            return plan
        limits = [self._limit(r) for r in decode]
        if not any(limits):
            return plan
        proposals = self.proposer.propose(decode, limits)
        room = policy.kv_room
        drafted: dict[int, list[int]] = {}
        self._masks.clear()
        for j, d in enumerate(proposals):
            d = d[: min(limits[j], room)]
            if d and decode[j].grammar is not None:
                n, mask = draft_masks(decode[j], d, self.vocab_size)
                d = d[:n]
                if mask is not None:
                    self._masks[decode[j]] = mask
            if d:
                drafted[j] = d
                room -= len(d)
        if not drafted:
            return plan
        extra = policy.alloc_kv(sum(len(d) for d in drafted.values()))
        num_ext_tokens = sum(plan.extend_lens[:ne])
        loc = plan.out_cache_loc
        spec: list[tuple[Req, list[int]]] = []
        spec_rows: list[torch.Tensor] = []
        plain: list[Req] = []
        plain_rows: list[torch.Tensor] = []
        used = 0
        for j, req in enumerate(decode):
            row = loc[num_ext_tokens + j : num_ext_tokens + j + 1]  # its newest token's row
            d = drafted.get(j)
            if d is None:
                plain.append(req)
                plain_rows.append(row)
                continue
            new = extra[used : used + len(d)]
            used += len(d)
            assert req.req_slot is not None
            policy.req_pool.write(req.req_slot, req.kv_len + 1, new)
            spec.append((req, d))
            spec_rows += [row, new]
        spec_reqs = [r for r, _ in spec]
        return replace(
            plan,
            reqs=plan.reqs[:ne] + spec_reqs + plain,
            prefix_lens=plan.prefix_lens[:ne] + [r.kv_len for r in spec_reqs + plain],
            extend_lens=plan.extend_lens[:ne] + [1 + len(d) for _, d in spec] + [1] * len(plain),
            out_cache_loc=torch.cat([loc[:num_ext_tokens], *spec_rows, *plain_rows]),
            num_extend=ne + len(spec),
            drafts=[[] for _ in range(ne)] + [d for _, d in spec],
        )

    def apply_masks(self, plan: Plan, logits: torch.Tensor, verify_logits: torch.Tensor) -> frozenset[Req]:
        """Mask the drafted rows under a grammar, in place: each verification row with the
        grammar's mask at its position, the row's sample row (after its last draft) with the
        mask there. ``logits``: float32 [len(plan.reqs), V]; returns the requests masked."""
        if not self._masks:
            return frozenset()
        verify_rows: list[int] = []
        verify_masks: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_masks: list[torch.Tensor] = []
        offset = 0
        for i, (req, d) in enumerate(zip(plan.reqs, plan.drafts, strict=False)):
            mask = self._masks.get(req)
            if mask is not None:
                verify_rows += range(offset, offset + len(d))
                verify_masks.append(mask[: len(d)])
                sample_rows.append(i)
                sample_masks.append(mask[len(d) :])
            offset += len(d)
        add_bitmask(verify_logits, verify_rows, torch.cat(verify_masks), self.runtime.to_device)
        add_bitmask(logits, sample_rows, torch.cat(sample_masks), self.runtime.to_device)
        masked = frozenset(self._masks)
        self._masks.clear()
        return masked

    def verify(self, plan: Plan, logits: torch.Tensor) -> dict[Req, Verified]:
        """Judge the plan's drafts on ``logits`` (float32 [sum of drafts, V], the model
        runner's verification rows) -> per drafted request its ``Verified``, the positions
        read back (the step's second device-to-host copy)."""
        reqs: list[Req] = []
        ids: list[int] = []
        out: dict[Req, Verified] = {}
        for req, d in zip(plan.reqs, plan.drafts, strict=False):
            if d:
                reqs += [req] * len(d)
                ids += d
                out[req] = Verified(d)
        if not out:
            return out
        drafts = self.runtime.to_device(torch.tensor(ids, dtype=torch.int64))
        positions = verify(self.sampler, logits, reqs, drafts).to_host(self.runtime)
        at = 0
        for v in out.values():
            v.positions = positions[at : at + len(v.drafts)]
            at += len(v.drafts)
        return out

    def settle(self, req: Req, v: Verified, policy: SchedulePolicy) -> None:
        """After verification: free the KV rows of ``req``'s rejected drafts, adapt its draft
        length and count. ``req.kv_len`` was advanced over every draft by the launch."""
        kept = v.kept
        rejected = len(v.drafts) - kept
        if rejected and req.req_slot is not None:
            rows = policy.req_pool.req_to_token[req.req_slot, req.kv_len - rejected : req.kv_len]
            policy.kv_pool.free(rows.to(torch.int64))
            req.kv_len -= rejected
        self.backoff.setdefault(req, Backoff(self.num_draft_tokens)).record(len(v.drafts), kept,
                                                                            self.num_draft_tokens)
        self.stats.proposed += len(v.drafts)
        self.stats.accepted += kept
        self.stats.verify_rows += 1

    def forget(self, req: Req) -> None:
        """``req`` left the engine."""
        self.backoff.pop(req, None)
        self.proposer.forget(req)
