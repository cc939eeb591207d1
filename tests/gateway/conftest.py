"""A scripted in-test Tokenizer gRPC servicer and the gateway served by uvicorn in front of it.

The fake yields the GenerateOutputs a test scripts and raises the gRPC statuses it scripts,
so these tests check the gateway's own behaviour (framing, schema, error mapping,
cancellation) with no model.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest_asyncio
import uvicorn

from ringserve import grpcutil
from ringserve.apikeys import ApiKeys
from ringserve.v1 import common_pb2, lora_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig

MODEL = "smol"


@dataclass
class Fail:
    """Script step: end the call with a gRPC status (and trailing metadata)."""

    code: grpc.StatusCode
    details: str
    metadata: tuple[tuple[str, str], ...] = ()


class Hang:
    """Script step: wait until the call is cancelled."""


def out(
    text: str = "", index: int = 0, finish: str | None = None, completion: int = 1, **kw
) -> tokenizer_pb2.GenerateOutput:
    """A GenerateOutput; finish is None, "stop", "length" or "abort"; extra kw go to FinishReason."""
    types = {None: common_pb2.FINISH_NONE, "stop": common_pb2.FINISH_STOP, "length": common_pb2.FINISH_LENGTH,
             "abort": common_pb2.FINISH_ABORT}
    return tokenizer_pb2.GenerateOutput(
        rid="r", index=index, text=text, prompt_tokens=7, completion_tokens=completion, cached_tokens=3,
        finish_reason=common_pb2.FinishReason(type=types[finish], **kw), output_ids=[100 + completion],
    )


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self) -> None:
        self.script: list = []
        self.requests: list[tokenizer_pb2.GenerateReqInput] = []
        self.cancelled = asyncio.Event()
        self.tokenize_requests: list[tokenizer_pb2.TokenizeRequest] = []
        self.pieces_requests: list[list[int]] = []
        self.authorizations: list[str | None] = []  # each Generate call's authorization metadata
        self.metadata: list[dict[str, str]] = []  # each Generate call's whole metadata
        self.readiness = tokenizer_pb2.Readiness(ready=True, replicas=1)  # what GetReadiness answers
        self.embed_requests: list[tokenizer_pb2.EmbedRequest] = []
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> path (tests/gateway/test_gateway_lora.py)

    def reset(self, *steps) -> None:
        self.script = list(steps)
        self.requests.clear()
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        self.authorizations.append(dict(context.invocation_metadata()).get("authorization"))
        self.metadata.append(dict(context.invocation_metadata()))
        try:
            for step in list(self.script):
                if isinstance(step, Fail):
                    await context.abort(step.code, step.details, trailing_metadata=step.metadata)
                elif isinstance(step, Hang):
                    await asyncio.sleep(3600)
                else:
                    yield step
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Embed(self, request, context):
        """Each input's vector is [its index, 0.5, -its length]; a scripted Fail or Hang applies first."""
        self.embed_requests.append(request)
        for step in self.script:
            if isinstance(step, Fail):
                await context.abort(step.code, step.details, trailing_metadata=step.metadata)
            elif isinstance(step, Hang):
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
        resp = tokenizer_pb2.EmbedResponse()
        for i, item in enumerate(request.inputs):
            n = len(item.text) if item.WhichOneof("input") == "text" else len(item.input_ids.ids)
            resp.embeddings.add(values=[float(i), 0.5, -float(n)], prompt_tokens=n)
        resp.prompt_tokens = sum(e.prompt_tokens for e in resp.embeddings)
        return resp

    def _adapter_list(self) -> lora_pb2.LoraAdapterList:
        return lora_pb2.LoraAdapterList(
            adapters=[lora_pb2.LoraAdapter(name=n, path=p, rank=4) for n, p in self.adapters.items()], max_loras=2)

    async def ListLoraAdapters(self, request, context):
        return self._adapter_list()

    async def LoadLoraAdapter(self, request, context):
        """Refuses a path outside /adapters/ as a scheduler refuses an adapter it cannot serve."""
        if not request.lora_path.startswith("/adapters/"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"adapter {request.lora_path}: no adapter_config.json")
        self.adapters[request.lora_name] = request.lora_path
        return self._adapter_list()

    async def UnloadLoraAdapter(self, request, context):
        if self.adapters.pop(request.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.lora_name!r} is loaded")
        return self._adapter_list()

    async def GetModelInfo(self, request, context):
        return tokenizer_pb2.ModelInfo(
            model_path="/models/SmolLM2", served_model_name=MODEL, context_length=2048, vocab_size=49152
        )

    async def Tokenize(self, request, context):
        self.tokenize_requests.append(request)
        prompt = request.text if request.WhichOneof("input") == "text" else "<|im_start|>user\nhi<|im_end|>\n"
        return tokenizer_pb2.TokenizeResponse(input_ids=[1, 2, 3], prompt=prompt, count=3, max_model_len=2048)

    async def Detokenize(self, request, context):
        return tokenizer_pb2.DetokenizeResponse(text="".join(f"<{i}>" for i in request.ids))

    async def TokenPieces(self, request, context):
        self.pieces_requests.append(list(request.ids))
        texts = [f"<{i}>" for i in request.ids]
        return tokenizer_pb2.TokenPiecesResponse(texts=texts, token_bytes=[t.encode() for t in texts])

    async def Abort(self, request, context):
        return tokenizer_pb2.AbortResponse(found=request.rid == "known")

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(instance_id="tok-0", num_running_reqs=2, num_waiting_reqs=1)

    async def GetReadiness(self, request, context):
        return self.readiness

    async def GetClusterLoad(self, request, context):
        return tokenizer_pb2.ClusterLoad(
            tokenizer=common_pb2.LoadReport(instance_id="tok-0", req_states=3),
            schedulers=[common_pb2.LoadReport(instance_id="scheduler-0", num_running_reqs=2, num_waiting_reqs=1,
                                              req_slots_used=2, kv_used_tokens=40, kv_cached_tokens=7)],
            detokenizers=[common_pb2.LoadReport(instance_id="detokenizer-0", decode_states=2)],
        )


@dataclass
class Stack:
    """What a test gets: the fake, its gRPC server, an HTTP client on the gateway, and the
    script helpers (test modules cannot import conftest under --import-mode=importlib)."""

    fake: FakeTokenizer
    server: grpcutil.ServingServer
    client: httpx.AsyncClient
    out = staticmethod(out)
    Fail = Fail
    Hang = Hang
    model = MODEL


async def _serve_gateway(config: GatewayConfig) -> tuple[uvicorn.Server, asyncio.Task, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def tokenizer_server() -> AsyncIterator[tuple[FakeTokenizer, grpcutil.ServingServer]]:
    fake = FakeTokenizer()
    server = await grpcutil.start_server(
        "127.0.0.1:0", [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, fake, "ringserve.v1.Tokenizer")]
    )
    await server.set_serving(True)
    yield fake, server
    await server.stop(0)


async def _gateway(config: GatewayConfig) -> AsyncIterator[httpx.AsyncClient]:
    server, task, url = await _serve_gateway(config)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client
    server.should_exit = True
    await task


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack(tokenizer_server) -> AsyncIterator[Stack]:
    """The gateway in front of the fake tokenizer; each test scripts ``stack.fake``."""
    fake, server = tokenizer_server
    async for client in _gateway(GatewayConfig(tokenizer=f"127.0.0.1:{server.port}")):
        yield Stack(fake, server, client)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def keyed(tokenizer_server) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway started with --api-key sekrit --api-key rotated."""
    _, server = tokenizer_server
    keys = ApiKeys(("sekrit", "rotated"))
    async for client in _gateway(GatewayConfig(tokenizer=f"127.0.0.1:{server.port}", api_keys=keys)):
        yield client


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def thinking(tokenizer_server) -> AsyncIterator[Stack]:
    """A gateway started with --reasoning-parser deepseek_r1, in front of the fake."""
    fake, server = tokenizer_server
    async for client in _gateway(GatewayConfig(tokenizer=f"127.0.0.1:{server.port}", reasoning_parser="deepseek_r1")):
        yield Stack(fake, server, client)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def qwen3_no_store(tokenizer_server) -> AsyncIterator[Stack]:
    """A gateway started with --reasoning-parser qwen3 --responses-store-max 0, in front of the fake."""
    fake, server = tokenizer_server
    config = GatewayConfig(tokenizer=f"127.0.0.1:{server.port}", reasoning_parser="qwen3", responses_store_max=0)
    async for client in _gateway(config):
        yield Stack(fake, server, client)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def quick_probe(tokenizer_server) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway whose /health_generate gives up after 0.3 s."""
    _, server = tokenizer_server
    config = GatewayConfig(tokenizer=f"127.0.0.1:{server.port}", health_generate_timeout_s=0.3)
    async for client in _gateway(config):
        yield client


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def orphan() -> AsyncIterator[httpx.AsyncClient]:
    """A gateway whose tokenizer address has nothing listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    async for client in _gateway(GatewayConfig(tokenizer=f"127.0.0.1:{port}")):
        yield client
