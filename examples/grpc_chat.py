"""Stream a chat answer from ringserve's gRPC API, sync and async.

Run the stack (`make run`: the gRPC API on 127.0.0.1:30010, or GRPC_PORT=), then:

    .venv/bin/python examples/grpc_chat.py 127.0.0.1:30010 "What is the capital of Japan?"

With an API key (the ring started with `--api-key KEY`) and/or TLS:

    RINGSERVE_API_KEY=KEY .venv/bin/python examples/grpc_chat.py 127.0.0.1:30010
    .venv/bin/python examples/grpc_chat.py grpc.example.com:443 --api-key KEY --tls
    .venv/bin/python examples/grpc_chat.py 127.0.0.1:30010 --ca-file ca.pem --cert-file cert.pem --key-file key.pem

`--timeout S` sets each call's deadline; when it passes the server aborts the request.
"""

import argparse
import asyncio
import os

from ringserve.client import AsyncRingserveClient, RingserveClient


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def sync_chat(target: str, question: str, timeout_s: float | None, **connection) -> None:
    with RingserveClient(target, **connection) as client:
        for chunk in client.chat(messages(question), max_new_tokens=64, temperature=0.0, timeout_s=timeout_s):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[finish_reason={chunk.finish_reason}, tokens={chunk.completion_tokens}]")


async def async_chat(target: str, question: str, timeout_s: float | None, **connection) -> None:
    async with AsyncRingserveClient(target, **connection) as client:
        async for chunk in client.chat(messages(question), max_new_tokens=64, temperature=0.0, timeout_s=timeout_s):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[finish_reason={chunk.finish_reason}, tokens={chunk.completion_tokens}]")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="the tokenizer's gRPC address, host:port")
    p.add_argument("question", nargs="?", default="What is the capital of Japan?")
    p.add_argument("--api-key", default=os.environ.get("RINGSERVE_API_KEY"),
                   help="sent as 'authorization: Bearer <key>' (default: $RINGSERVE_API_KEY)")
    p.add_argument("--tls", action="store_true", help="TLS, verifying the server against the system roots")
    p.add_argument("--ca-file", help="TLS, verifying the server against this CA (PEM)")
    p.add_argument("--cert-file", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--key-file", help="its private key (PEM)")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each call (s)")
    a = p.parse_args()
    connection = dict(api_key=a.api_key, tls=a.tls, ca_file=a.ca_file, cert_file=a.cert_file, key_file=a.key_file)
    sync_chat(a.target, a.question, a.timeout, **connection)
    asyncio.run(async_chat(a.target, a.question, a.timeout, **connection))
