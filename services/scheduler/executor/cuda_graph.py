"""Decode steps from static buffers, padded to batch-size buckets, replayed as CUDA graphs.

As SGLang's ``CudaGraphRunner`` and nano-vllm's ``capture_cudagraph``: at start-up the
decode forward (embedding to logits) is captured once per bucket size, largest first,
all graphs sharing one memory pool; a decode-only step of B <= ``max_bs`` requests copies
its inputs into the first B rows of the static buffers, pads the rest of its bucket with
rows that read and write only the padding row of the KV pool (req slot ``pad_slot``,
KV row ``pad_row``, one key), replays that bucket's graph and reads the first B rows of its
logits. Graphs are never captured again after start-up.

Only a backend whose kernel launches depend on nothing but the bucket size can be
captured (``AttentionBackend.supports_cuda_graph``: the Triton backend, which reads the
whole req-to-token table through each row's slot and stops at its ``seq_lens`` on the
device). Without capture (``capture=False``, and always on the CPU) the same buffer path
runs the forward eagerly on the bucket's rows: that is how it is tested without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from services.scheduler.attention.paged import AttnMetadata, DecodeLayout
from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.model_runner import FutureIds, StepInputs
from services.scheduler.models.base import CausalLM
from services.scheduler.policy.kv_pool import GIB, ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.schedule import Plan

log = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured for ``max_bs``: 1, 2, 4, 8, then every multiple of 8 up to it
    (SGLang's default list), ``max_bs`` itself always included.

    Raises:
        ValueError: ``max_bs`` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1; got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes) | {max_bs})


class DecodeGraphRunner:
    """Static input buffers and one captured graph (or, uncaptured, an eager forward) per bucket.

    Args:
        max_bs: the largest batch a graph runs (``--cuda-graph-max-bs``); larger decode
            batches and every step with an extend part run outside.
        capture: capture CUDA graphs (CUDA devices only) or run the bucket's rows eagerly.
    """

    _NAMES = ("input_ids", "positions", "out_cache_loc", "dec_slots", "seq_lens")

    def __init__(self, model: CausalLM, runtime: DeviceRuntime, req_pool: ReqToTokenPool,
                 kv_pool: TokenToKVPool, max_bs: int, capture: bool):
        self.model = model
        self.runtime = runtime
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        dev = runtime.device
        self.buffers = {name: torch.zeros(self.max_bs, dtype=torch.int64, device=dev) for name in self._NAMES}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` rows."""
        return next(b for b in self.buckets if b >= n)

    def can_run(self, plan: Plan) -> bool:
        return plan.is_decode and len(plan.reqs) <= self.max_bs

    def forward(self, plan: Plan, future: FutureIds | None = None) -> torch.Tensor:
        """A decode-only plan -> float32 logits [B, vocab] (a view of the bucket's output);
        ``future`` as in ``ModelRunner.forward``."""
        n = len(plan.reqs)
        bs = self.bucket(n)
        inputs = StepInputs(self.req_pool, future)
        dec = inputs.add_decode(plan.reqs, plan.prefix_lens, pad_to=bs, pad_slot=self.req_pool.pad_slot)
        loc = torch.cat((plan.out_cache_loc, torch.full((bs - n,), self.kv_pool.pad_row, dtype=torch.int64)))
        dev = inputs.to_device(self.runtime, loc)
        for name in self._NAMES:
            # aten's copy_ rather than Tensor.copy_, whose Python binding sets a device guard
            # that a CPU-only torch cannot set for (fake) CUDA tensors; the same kernel on a GPU.
            torch.ops.aten.copy_.default(self.buffers[name].narrow(0, 0, bs), dev[name])
        if bs in self.graphs:
            self.graphs[bs].replay()
            logits = self.logits[bs]
        else:
            logits = self._run(bs, dec["max_seq_len"], dec["uniform"])
        return logits.narrow(0, 0, n)

    def _run(self, bs: int, max_seq_len: int, uniform: bool) -> torch.Tensor:
        buf = {name: t.narrow(0, 0, bs) for name, t in self.buffers.items()}
        meta = AttnMetadata(buf["out_cache_loc"], self.req_pool.device_table, 0,
                            decode=DecodeLayout(buf["dec_slots"], buf["seq_lens"], max_seq_len, uniform))
        hidden = self.model(buf["input_ids"], buf["positions"], meta, self.kv_pool)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first, into one memory pool; logs time and memory."""
        if not self.model.attn_backend.supports_cuda_graph:
            raise RuntimeError(f"attention backend {self.model.attn_backend.name!r} cannot run in a CUDA graph; "
                               "use --attention-backend triton or --disable-cuda-graph")
        dev = self.runtime.device
        started, free_before = time.monotonic(), torch.cuda.mem_get_info(dev)[0]
        self.buffers["out_cache_loc"].fill_(self.kv_pool.pad_row)
        self.buffers["dec_slots"].fill_(self.req_pool.pad_slot)
        self.buffers["seq_lens"].fill_(1)
        width = self.req_pool.req_to_token.shape[1]
        pool = None
        stream = torch.cuda.Stream(dev)
        for bs in reversed(self.buckets):
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    self._run(bs, width, True)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._run(bs, width, True)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s, %.2f GiB",
                 len(self.graphs), self.max_bs, time.monotonic() - started, used / GIB)
