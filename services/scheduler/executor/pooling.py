"""Embeddings: an embedding request's prompt is prefilled like any other (in the same steps as
the running decodes, a chunk at a time when it is long), samples nothing, and ends with its
final hidden states pooled -- what ``/v1/embeddings`` and the ``Embed`` RPC return.

The hidden state pooled is the one transformers reports as the last hidden state: the model's
output after the final norm (``CausalLM.final_norm``), in float32. Three pooling modes, as
sentence-transformers names them (``ringserve.modelfacts.POOLING_MODES``):

- ``last``: the last prompt token's (decoder embedding models: Qwen3-Embedding, whose
  tokenizer appends ``<|endoftext|>`` to every text so that the last token sees it all);
- ``mean``: the mean over every prompt token;
- ``cls``: the first prompt token's.

Per step the engine names the packed extend rows each embedding pools (``plan_pool_rows``):
last-token pooling only the last row of the chunk that ends the prompt, cls only position 0's,
mean every row of the chunk. The model runner normalises those rows and sums them per request
in one ``index_add_`` (``pool_rows``), on the device. Mean pooling adds each chunk's sum,
divided by the prompt length, to the request's ``pool_sum``, so a prompt prefilled in chunks
pools exactly what one pass would; a chunk that starts at position 0 starts the sum afresh
(a retracted request is prefilled again from the start: mean and cls pooling never take
positions from the prefix cache, ``Req.pool_from``). When the prompt's last chunk has run,
``finish_embeddings`` cuts each vector to the dimensions asked for, L2-normalises it when the
pooling config says so, and starts the one device-to-host copy of every finished vector; the
engine emits them when the step's results are processed (overlap scheduling: a step later).

Prefix cache: last-token pooling reads only the last position, which is always recomputed, so
an embedding takes a cached prefix like any prefill (a shared instruction such as Qwen3-
Embedding's "Instruct: ... Query:" is computed once); mean and cls pooling read every position
or the first, so they take none. Every embedding's KV goes into the cache when it ends, like
any finished request's, and is evicted like it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.models.base import CausalLM
from services.scheduler.policy.req import Req
from services.scheduler.policy.schedule import Plan


@dataclass(frozen=True)
class PoolRows:
    """The extend rows one step pools, on the host.

    Attributes:
        rows: int64 [R], packed token indices of the rows pooled.
        index: int64 [R], for each row the pooled vector it adds to (0 .. len(spans) - 1).
        spans: per pooled vector, its request and whether the chunk starts the prompt.
    """

    rows: torch.Tensor
    index: torch.Tensor
    spans: tuple[tuple[Req, bool], ...]


def pool_from(req: Req, mode: str) -> int:
    """The first prompt position whose hidden state ``mode`` reads: the prefix cache supplies
    only the positions before it (``Req.pool_from``)."""
    return req.prompt_len - 1 if mode == "last" else 0


def plan_pool_rows(plan: Plan, mode: str) -> None:
    """Set ``plan.pool`` to the rows the plan's embedding requests pool (None when none does).

    Args:
        mode: ``last``, ``mean`` or ``cls`` (module docstring).
    """
    rows: list[int] = []
    index: list[int] = []
    spans: list[tuple[Req, bool]] = []
    offset = 0
    e = plan.num_extend
    for req, prefix, n in zip(plan.reqs[:e], plan.prefix_lens[:e], plan.extend_lens[:e], strict=True):
        if req.embed:
            if mode == "mean":
                picked = range(offset, offset + n)
            elif mode == "cls":
                picked = range(offset, offset + 1) if prefix == 0 else range(0)
            else:
                picked = range(offset + n - 1, offset + n) if prefix + n == req.prompt_len else range(0)
            if picked:
                rows.extend(picked)
                index.extend([len(spans)] * len(picked))
                spans.append((req, prefix == 0))
        offset += n
    plan.pool = PoolRows(torch.tensor(rows, dtype=torch.int64), torch.tensor(index, dtype=torch.int64),
                         tuple(spans)) if spans else None


def pool_rows(model: CausalLM, hidden: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
              count: int) -> torch.Tensor:
    """The per-request sums of the final-normed hidden states of ``rows``.

    Args:
        hidden: [T, hidden], the step's final hidden states before the final norm (device).
        rows, index: int64 [R] on the device (``PoolRows``).
        count: how many sums (``len(PoolRows.spans)``).

    Returns:
        float32 [count, hidden] on the device: row e is the sum of the rows whose index is e.
    """
    normed = model.final_norm(hidden.index_select(0, rows)).float()  # [R, hidden]
    out = torch.zeros((count, normed.shape[1]), dtype=torch.float32, device=normed.device)
    return out.index_add_(0, index, normed)


def accumulate(plan: Plan, mode: str) -> None:
    """Fold the step's pooled sums (``plan.pooled``) into each embedding request's ``pool_sum``."""
    if plan.pool is None:
        return
    pooled = plan.pooled
    assert pooled is not None, "the model runner pools every plan with pool rows"
    for e, (req, starts) in enumerate(plan.pool.spans):
        part = pooled.select(0, e)
        if mode != "mean":
            req.pool_sum = part
            continue
        part = part / req.prompt_len
        req.pool_sum = part if starts or req.pool_sum is None else req.pool_sum + part
    plan.pooled = None


def finish_embeddings(reqs: list[Req], normalize: bool, runtime: DeviceRuntime) -> Callable[[], list[list[float]]]:
    """Start the one device-to-host copy of ``reqs``' embeddings (prefill done): each pooled
    vector cut to its request's ``embed_dimensions`` (0: all), then L2-normalised when
    ``normalize`` (as ``torch.nn.functional.normalize``: divided by max(norm, 1e-12)). Cutting
    before normalising is how Matryoshka embeddings are shortened (vLLM, sentence-transformers'
    ``truncate_dim``).

    Returns:
        A function that waits for the copy -> one list of floats per request, in order.
    """
    vecs = []
    for req in reqs:
        v = req.pool_sum
        assert v is not None, f"embedding {req.rid} ended without a pooled row"
        if 0 < req.embed_dimensions < v.shape[0]:
            v = v.narrow(0, 0, req.embed_dimensions)
        vecs.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
        req.pool_sum = None
    sizes = [v.shape[0] for v in vecs]
    host = runtime.to_host_async(torch.cat(vecs))

    def wait() -> list[list[float]]:
        flat = host().tolist()
        out, at = [], 0
        for n in sizes:
            out.append(flat[at : at + n])
            at += n
        return out

    return wait
