"""Stream a chat answer from ringserve's gRPC API, sync and async.

Run the stack (`make run`: the gRPC API on 127.0.0.1:30010, or GRPC_PORT=), then:

    .venv/bin/python examples/grpc_chat.py 127.0.0.1:30010 "What is the capital of France?"
"""

import asyncio
import sys

from ringserve.client import AsyncRingserveClient, RingserveClient


def sync_chat(target: str, question: str) -> None:
    with RingserveClient(target) as client:
        for chunk in client.chat([{"role": "user", "content": question}], max_new_tokens=64, temperature=0.0):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[finish_reason={chunk.finish_reason}, tokens={chunk.completion_tokens}]")


async def async_chat(target: str, question: str) -> None:
    async with AsyncRingserveClient(target) as client:
        async for chunk in client.chat([{"role": "user", "content": question}], max_new_tokens=64, temperature=0.0):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[finish_reason={chunk.finish_reason}, tokens={chunk.completion_tokens}]")


if __name__ == "__main__":
    target, question = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "What is the capital of France?"
    sync_chat(target, question)
    asyncio.run(async_chat(target, question))
