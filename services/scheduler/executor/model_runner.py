"""Runs the model on a plan: packs the step's inputs on the host, copies them to the device
once, builds the attention layout there, returns logits.

Per step the host builds every index the device needs from the plan's Python lists --
token ids, positions, KV rows, req slots, lengths, the packed-token map of the extend
part, the rows that sample, and the req-to-token entries written since the last step --
into one int64 tensor, which ``DeviceRuntime.to_device`` copies in one go (pinned and
non-blocking on CUDA). Everything the layers need to size a shape is a host int taken
from the plan, so the forward never reads the device.

That packed tensor and those host ints (a ``StepBatch``) are the whole step: under tensor
parallelism rank 0 hands them to ``broadcast`` before running them, and every other rank
runs the same ``execute`` on its shard (``executor.tp``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.scheduler.attention.paged import AttnMetadata, DecodeLayout, ExtendLayout
from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.pooling import pool_rows
from services.scheduler.executor.step_threads import StepThreads
from services.scheduler.lora.layers import LoraBatch
from services.scheduler.lora.registry import step_rows
from services.scheduler.models.base import CausalLM
from services.scheduler.policy.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.req import Req
from services.scheduler.policy.schedule import Plan


class ModelRunner:
    """Executes plans against one model and its KV cache (``executor.build.build_stack`` makes it,
    the model's linears already packed and made batch-invariant as the runtime decided).

    Args:
        runtime: the device runtime (default: the plain one for the model's device).
        graph_runner: runs decode-only steps from static buffers (``executor.cuda_graph``),
            or None to run every step as it comes.
        batch_invariant: deterministic inference: every extend token attends as a decode
            query (``ExtendLayout.token_seq_lens``); the model's backend must be
            ``batch_invariant`` and its linears made so (``layers.batch_invariant``).
        lora: the model's ``lora.layers.LoraBatch`` (LoRA on), told each step's rows per
            adapter; a step with adapter rows runs eagerly (the CUDA graphs hold the base model).

    Attributes:
        broadcast: called with each step's ``StepBatch`` before it runs (tensor parallelism:
            rank 0 sends it to the other ranks); None on a single rank.
        step_threads: sets the thread count of each step from its token count
            (``executor.step_threads``; the engine thread installs it); None leaves it.
    """

    def __init__(self, model: CausalLM, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool,
                 runtime: DeviceRuntime | None = None, graph_runner=None, batch_invariant: bool = False,
                 lora: LoraBatch | None = None):
        self.model = model
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.runtime = runtime or DeviceRuntime(next(model.parameters()).device)
        self.graph_runner = graph_runner
        self.batch_invariant = batch_invariant
        self.lora = lora
        self.broadcast: Callable[[StepBatch], None] | None = None
        self.step_threads: StepThreads | None = None

    @torch.inference_mode()
    def forward(self, plan: Plan, future: FutureIds | None = None) -> torch.Tensor:
        """Run one step -> float32 logits [B, vocab] on the device, row i for plan.reqs[i]'s last new token.

        The extend part's tokens are packed first, then one token per decoding request.
        A plan with drafts (speculative decoding) returns ``B + sum(len(d) for d in plan.drafts)``
        rows: after the B, the logits at each drafted row's newest token and at each of its
        drafts but the last, row by row (``StepInputs.add_verify``).

        Args:
            future: under overlap scheduling, the step still in flight: decode rows whose
                last token it sampled take their input id from its device tensor.
        """
        lora = step_rows([r.lora.slot if r.lora is not None else None for r in plan.reqs],
                         plan.extend_lens) if self.lora is not None else None
        if self.graph_runner is not None and lora is None and self.graph_runner.can_run(plan):
            return self.graph_runner.forward(plan, future)
        inputs = StepInputs(self.req_pool, future)
        if lora is not None:
            inputs.add("lora_rows", lora[0])
        ne, nd = plan.num_extend, len(plan.reqs) - plan.num_extend
        ext = inputs.add_extend(plan, self.batch_invariant) if ne else None
        dec = inputs.add_decode(plan.reqs[ne:], plan.prefix_lens[ne:]) if nd else None
        if plan.drafts:  # speculative decoding: the logits that judge each draft follow the rows that sample
            inputs.add_verify(plan)
        if plan.pool is not None:  # embeddings: their rows ride in the step's one copy
            inputs.add("pool_rows", plan.pool.rows)
            inputs.add("pool_index", plan.pool.index)
        names, sizes, host = inputs.pack(plan.out_cache_loc)
        batch = StepBatch(names, sizes, host, inputs.num_extend_tokens, ext, dec, plan.logprob_rows,
                          len(plan.pool.spans) if plan.pool is not None else 0, lora[1] if lora is not None else None)
        if self.broadcast is not None:
            self.broadcast(batch)
        logits, plan.logprob_hidden, plan.pooled = self.execute(batch, future)
        return logits

    def execute(self, batch: StepBatch, future: FutureIds | None = None) -> StepResult:
        """Run one packed step -> (float32 logits [B, vocab] of the rows that sample, the
        hidden states [R, hidden] of ``batch.logprob_rows`` or None, the pooled sums
        float32 [E, hidden] of the embeddings' rows or None: ``executor.pooling``).

        Raises:
            layers.parallel.RankFailure: under tensor parallelism, a collective failed.
        """
        if self.step_threads is not None:
            self.step_threads.for_step(batch.sizes[batch.names.index("input_ids")])
        dev = upload(self.runtime, self.req_pool, batch.names, batch.sizes, batch.host)
        if future is not None:
            take_future_ids(dev, future, batch.num_extend_tokens)
        meta = AttnMetadata(dev["out_cache_loc"], self.req_pool.device_table, batch.num_extend_tokens)
        if batch.extend is not None:
            meta.extend = ExtendLayout(dev["ext_slots"], dev["prefix_lens"], dev["extend_lens"], dev["q_valid"],
                                       **batch.extend, token_rows=dev.get("token_rows"),
                                       token_slots=dev.get("token_slots"), token_seq_lens=dev.get("token_seq_lens"))
        if batch.decode is not None:
            meta.decode = DecodeLayout(dev["dec_slots"], dev["seq_lens"], **batch.decode)
        if self.lora is not None:
            self.lora.set(batch.lora, dev.pop("lora_rows", None))
        try:
            hidden = self.model(dev["input_ids"], dev["positions"], meta, self.kv_pool)
        finally:
            if self.lora is not None:
                self.lora.set(None, None)
        logprob_hidden = pooled = None
        if batch.logprob_rows is not None:  # prompt logprobs: at most a chunk of rows
            logprob_hidden = hidden.index_select(0, self.runtime.to_device(batch.logprob_rows))
        if batch.num_pooled:
            pooled = pool_rows(self.model, hidden, dev["pool_rows"], dev["pool_index"], batch.num_pooled)
        if "sample_index" in dev:
            hidden = hidden.index_select(0, dev["sample_index"])
        return StepResult(self.model.compute_logits(hidden), logprob_hidden, pooled)


class StepResult(NamedTuple):
    """What one step's forward leaves on the device (``ModelRunner.execute``)."""

    logits: torch.Tensor  # float32 [B, vocab], the rows that sample
    logprob_hidden: torch.Tensor | None  # [R, hidden], the rows prompt logprobs score
    pooled: torch.Tensor | None  # float32 [E, hidden], the embeddings' pooled sums


@dataclass
class StepBatch:
    """One step as the host packed it: what every tensor-parallel rank runs (picklable).

    Attributes:
        names, sizes: the segments of ``host``, in order (see ``StepInputs``).
        host: int64 [sum(sizes)], every per-step index on the host.
        num_extend_tokens: packed tokens of the extend part.
        extend, decode: the host fields of ``ExtendLayout`` / ``DecodeLayout`` (None: no such part).
        logprob_rows: int64 [R] host, packed token indices whose hidden states prompt logprobs
            score, or None.
        num_pooled: embeddings pooled this step (the segments ``pool_rows`` / ``pool_index``
            of ``host`` name their rows; ``executor.pooling``).
        lora: (adapter slot, row count) per adapter present, whose rows are the segment
            ``lora_rows`` in that order (``lora.registry.step_rows``); None: no adapter rows.
    """

    names: list[str]
    sizes: list[int]
    host: torch.Tensor
    num_extend_tokens: int
    extend: dict | None
    decode: dict | None
    logprob_rows: torch.Tensor | None = None
    num_pooled: int = 0
    lora: list[tuple[int, int]] | None = None


@dataclass
class FutureIds:
    """The in-flight step's sampled ids on the device and which request sampled each row
    (overlap scheduling: the next step is planned before they reach the host)."""

    next_ids: torch.Tensor  # int64 [R] on the device
    rows: dict[Req, int]  # request -> row of next_ids


class StepInputs:
    """The host side of one step: named int64 segments, packed for one host-to-device copy.

    Also applies the req-to-token writes the scheduler made since the last step to the
    device copy of the table (``ReqToTokenPool.take_writes``), inside the same copy, and
    under overlap scheduling takes the decode rows' input ids that the in-flight step
    sampled from its device tensor (``future``).
    """

    def __init__(self, req_pool: ReqToTokenPool, future: FutureIds | None = None):
        self.req_pool = req_pool
        self.future = future
        self.segments: dict[str, torch.Tensor] = {}
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.num_extend_tokens = 0

    def add(self, name: str, values) -> None:
        self.segments[name] = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)

    def add_extend(self, plan: Plan, per_token: bool = False) -> dict:
        """The extend part's ids, positions and layout inputs; returns the layout's host fields.

        ``per_token`` adds each token's request index, req slot and key count (its
        position + 1) for the batch-invariant extend (``ExtendLayout.token_seq_lens``).
        """
        end = plan.num_extend
        reqs, prefix, ext = plan.reqs[:end], plan.prefix_lens[:end], plan.extend_lens[:end]
        lq = max(ext)
        q_valid: list[int] = []
        token_rows: list[int] = []
        token_slots: list[int] = []
        for b, (req, p, n) in enumerate(zip(reqs, prefix, ext, strict=True)):
            drafts = plan.drafts[b] if plan.drafts else []
            self.ids.extend((req.fill_ids() + drafts if drafts else req.fill_ids())[p : p + n])
            self.positions.extend(range(p, p + n))
            q_valid.extend(range(b * lq, b * lq + n))
            if per_token:
                token_rows.extend([b] * n)
                token_slots.extend([req.req_slot] * n)
        self.num_extend_tokens = len(self.ids)
        self.add("ext_slots", [r.req_slot for r in reqs])
        self.add("prefix_lens", prefix)
        self.add("extend_lens", ext)
        self.add("q_valid", q_valid)
        if per_token:
            self.add("token_rows", token_rows)
            self.add("token_slots", token_slots)
            self.add("token_seq_lens", [pos + 1 for pos in self.positions])
        last, total = [], 0
        for n in ext:
            total += n
            last.append(total - 1)
        self.add("sample_index", last)
        return dict(max_extend_len=lq, max_seq_len=max(p + n for p, n in zip(prefix, ext, strict=True)),
                    plain_causal=len(reqs) == 1 and prefix[0] == 0)

    def add_decode(self, reqs, prefix_lens: list[int], pad_to: int | None = None, pad_slot: int = 0) -> dict:
        """One token per decoding request (padded to ``pad_to`` rows of ``pad_slot`` with
        one key each); returns the layout's host fields."""
        n = len(reqs)
        pad = (pad_to or n) - n
        seq_lens = [p + 1 for p in prefix_lens] + [1] * pad
        self.ids.extend([r.last_token() for r in reqs] + [0] * pad)
        self.positions.extend(list(prefix_lens) + [0] * pad)
        self.add("dec_slots", [r.req_slot for r in reqs] + [pad_slot] * pad)
        if self.future is not None:
            rows = [self.future.rows.get(r, -1) for r in reqs] + [-1] * pad
            if max(rows) >= 0:
                self.add("future_rows", rows)
        self.add("seq_lens", seq_lens)
        if "sample_index" in self.segments:  # a mixed step: the decode rows follow the extend part's
            self.add("sample_index", torch.cat((self.segments["sample_index"],
                                                torch.arange(self.num_extend_tokens, self.num_extend_tokens + n))))
        return dict(max_seq_len=max(seq_lens), uniform=min(seq_lens) == max(seq_lens))

    def add_verify(self, plan: Plan) -> None:
        """Append to the rows that sample the packed index of each drafted extend row's
        newest token and of its drafts but the last (the last one's logits are its sample row)."""
        index: list[int] = []
        offset = 0
        for d, n in zip(plan.drafts, plan.extend_lens[: plan.num_extend], strict=True):
            index.extend(range(offset, offset + len(d)))
            offset += n
        self.add("sample_index", torch.cat((self.segments["sample_index"], torch.tensor(index, dtype=torch.int64))))

    def pack(self, out_cache_loc: torch.Tensor) -> tuple[list[str], list[int], torch.Tensor]:
        """Every segment, ``out_cache_loc`` (host int64) and the pending req-to-token writes
        in one host tensor -> (segment names, their sizes, int64 [sum(sizes)])."""
        self.add("input_ids", self.ids)
        self.add("positions", self.positions)
        self.add("out_cache_loc", out_cache_loc)
        writes = self.req_pool.take_writes()
        if writes is not None:
            self.add("table_index", writes[0])
            self.add("table_rows", writes[1].to(torch.int64))
        names = list(self.segments)
        return names, [self.segments[k].numel() for k in names], torch.cat([self.segments[k] for k in names])

    def to_device(self, runtime: DeviceRuntime, out_cache_loc: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy every segment (and ``out_cache_loc``, host int64) to the device at once;
        applies the pending req-to-token writes there. Returns the device views by name."""
        dev = upload(runtime, self.req_pool, *self.pack(out_cache_loc))
        if self.future is not None:
            take_future_ids(dev, self.future, self.num_extend_tokens)
        return dev


def upload(runtime: DeviceRuntime, req_pool: ReqToTokenPool, names: list[str], sizes: list[int],
           host: torch.Tensor) -> dict[str, torch.Tensor]:
    """One host-to-device copy of a packed step (``StepInputs.pack``) -> device views by name;
    the req-to-token writes it carries are applied to ``req_pool.device_table``."""
    dev = dict(zip(names, runtime.to_device(host).split(sizes), strict=True))
    if "table_index" in dev:
        table = req_pool.device_table.view(-1)
        table.index_copy_(0, dev.pop("table_index"), dev.pop("table_rows").to(torch.int32))
    return dev


def take_future_ids(dev: dict[str, torch.Tensor], future: FutureIds, num_extend_tokens: int) -> None:
    """Overlap scheduling: decode rows whose last token the in-flight step sampled take it
    from ``future.next_ids`` (device) in ``dev["input_ids"]``."""
    if "future_rows" not in dev:
        return
    rows = dev.pop("future_rows")
    ids = dev["input_ids"]
    decode_ids = ids.narrow(0, num_extend_tokens, rows.numel())
    taken = future.next_ids.index_select(0, rows.clamp(min=0))
    decode_ids = torch.where(rows >= 0, taken, decode_ids)
    dev["input_ids"] = torch.cat((ids.narrow(0, 0, num_extend_tokens), decode_ids))
