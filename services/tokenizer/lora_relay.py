"""The public side of the LoRA RPCs: the tokenizer passes LoadLoraAdapter and
UnloadLoraAdapter on to every replica's scheduler, and ListLoraAdapters to the first.

Every replica serves the same adapters: a load or an unload goes to each, and the first
refusal is the answer (the replicas that took it keep it: a retry of a load is refused by
those as a name in use). A refusal reaches the client as the scheduler gave it, prefixed with
"replica K of N" when there are several; never with a scheduler's address, which is internal.
The schedulers hold the adapters; the tokenizer keeps no list of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from ringserve.v1 import lora_pb2, scheduler_pb2_grpc
from services.tokenizer.errors import RequestError, unavailable
from services.tokenizer.replicas import Replica

LORA_TIMEOUT_S = 60.0  # reading an adapter's files from a slow volume


async def relay_lora(replicas: Iterable[Replica], method: str, request: object,
                     everywhere: bool = True) -> lora_pb2.LoraAdapterList:
    """Call the Scheduler RPC ``method`` on every replica (``everywhere``) or on the first;
    returns the first replica's answer.

    Raises:
        RequestError: the first replica's refusal (its status and message) or UNAVAILABLE for
            a scheduler that is not connected or lost.
    """
    chosen = list(replicas) if everywhere else list(replicas)[:1]
    if not chosen:
        raise unavailable("this tokenizer has no scheduler")

    async def one(k: int, replica: Replica) -> lora_pb2.LoraAdapterList:
        which = f"replica {k + 1} of {len(chosen)}: " if len(chosen) > 1 else ""
        link = replica.scheduler
        if link.channel is None or not link.up:
            raise unavailable(f"{which}its scheduler is not connected")
        try:
            return await getattr(scheduler_pb2_grpc.SchedulerStub(link.channel), method)(
                request, timeout=LORA_TIMEOUT_S, metadata=link.metadata)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise unavailable(f"{which}lost its scheduler") from None
            raise RequestError(f"{which}{exc.details()}", code, code.name.lower()) from None

    results = await asyncio.gather(*(one(k, r) for k, r in enumerate(chosen)), return_exceptions=True)
    answers = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        answers.append(result)
    return answers[0]
