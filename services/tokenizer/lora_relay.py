"""The public side of the LoRA RPCs: the tokenizer passes LoadLoraAdapter and
UnloadLoraAdapter on to every replica's scheduler, and ListLoraAdapters to the first.

Every replica serves the same adapters: a load or an unload goes to each, and the first
refusal is the answer (the replicas that took it keep it: a retry of a load is refused by
those as a name in use, which names them). The schedulers hold the adapters; the tokenizer
keeps no list of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from ringserve.v1 import lora_pb2, scheduler_pb2_grpc
from services.tokenizer.errors import unavailable
from services.tokenizer.kv_relay import _relayed
from services.tokenizer.replicas import Replica

LORA_TIMEOUT_S = 60.0  # reading an adapter's files from a slow volume


async def relay_lora(replicas: Iterable[Replica], method: str, request: object,
                     everywhere: bool = True) -> lora_pb2.LoraAdapterList:
    """Call the Scheduler RPC ``method`` on every replica (``everywhere``) or on the first;
    returns the first replica's answer.

    Raises:
        RequestError: the first replica's refusal (its status, the replica named) or
            UNAVAILABLE for a scheduler that is not connected.
    """
    chosen = list(replicas) if everywhere else list(replicas)[:1]
    if not chosen:
        raise unavailable("this tokenizer has no scheduler")

    async def one(replica: Replica) -> lora_pb2.LoraAdapterList:
        link = replica.scheduler
        if link.channel is None or not link.up:
            raise unavailable(f"the scheduler at {replica.name} is not connected")
        try:
            return await getattr(scheduler_pb2_grpc.SchedulerStub(link.channel), method)(
                request, timeout=LORA_TIMEOUT_S, metadata=link.metadata)
        except grpc.aio.AioRpcError as exc:
            raise _relayed(exc, replica) from None

    results = await asyncio.gather(*(one(r) for r in chosen), return_exceptions=True)
    answers = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        answers.append(result)
    return answers[0]
