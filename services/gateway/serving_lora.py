"""LoRA adapters over HTTP: vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(their bodies and success texts), and the adapters' entries in ``/v1/models``.

The schedulers hold the adapters (``services/scheduler/lora``); the tokenizer passes a load or
an unload on to every replica. Refusals keep the API's error shape: 400 for an adapter that
cannot be served (its message names the file, the module or the rank at fault), a name in
use or ``--max-loras`` reached; 404 for unloading a name that is not loaded. Both endpoints
sit behind the API keys like every other path.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from pydantic import Field

from ringserve.v1 import lora_pb2
from services.gateway import schemas
from services.gateway.backend import ModelCard, TokenizerClient
from services.gateway.protocol import Body


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT adapter directory, as the scheduler's host sees it


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's body may carry it; adapters are named here


async def model_entries(client: TokenizerClient, card: ModelCard, entry: dict) -> list[dict]:
    """``/v1/models``' entries: the base model's (``entry``, its ``parent`` null), then one per
    loaded adapter with ``root`` its path and ``parent`` the base model (vLLM's shape)."""
    adapters = [{**entry, "id": a.name, "root": a.path, "parent": card.served_model_name}
                for a in await client.lora_adapters()]
    return [{**entry, "parent": None}, *adapters]


def add_routes(app: FastAPI, client_of) -> None:
    """Register the two endpoints on ``app`` (``client_of(request)``: the request's ``TokenizerClient``)."""

    @app.post("/v1/load_lora_adapter", response_class=Response,
              responses={200: {"content": {"text/plain": {}}}, **schemas.ERRORS})
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
        await client_of(request).unary(
            "LoadLoraAdapter", lora_pb2.LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path))
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", response_class=Response,
              responses={200: {"content": {"text/plain": {}}}, **schemas.ERRORS})
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
        await client_of(request).unary("UnloadLoraAdapter", lora_pb2.UnloadLoraAdapterRequest(lora_name=body.lora_name))
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")
