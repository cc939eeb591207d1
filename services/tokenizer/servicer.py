"""The ``ringserve.v1.Tokenizer`` gRPC servicer: a thin adapter over ``TokenizerManager``.

Every ``RequestError`` becomes a gRPC status with its message as details and
"code"/"param" trailing metadata (see ``services.tokenizer.errors``).
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.errors import RequestError
from services.tokenizer.manager import TokenizerManager

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


async def _fail(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    await context.abort(err.status, err.message, trailing_metadata=err.trailing_metadata())
    raise AssertionError("context.abort returned")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, manager: TokenizerManager):
        self.manager = manager

    async def Generate(self, request: tokenizer_pb2.GenerateReqInput, context: grpc.aio.ServicerContext) -> None:
        """Stream GenerateOutputs; a cancelled call aborts the request (through ``aclose``)."""
        outputs = self.manager.generate(request)
        try:
            async for out in outputs:
                await context.write(out)
        except RequestError as err:
            await _fail(context, err)
        finally:
            await outputs.aclose()

    async def Abort(self, request: tokenizer_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> tokenizer_pb2.AbortResponse:
        return tokenizer_pb2.AbortResponse(found=self.manager.abort(request.rid))

    async def GetModelInfo(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> tokenizer_pb2.ModelInfo:
        return self.manager.model_info()

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        try:
            return self.manager.tokenize(request)
        except RequestError as err:
            await _fail(context, err)

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        try:
            return self.manager.detokenize(request)
        except RequestError as err:
            await _fail(context, err)

    async def TokenPieces(
        self, request: tokenizer_pb2.TokenIds, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenPiecesResponse:
        try:
            return self.manager.token_pieces(request)
        except RequestError as err:
            await _fail(context, err)

    async def GetLoad(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        return self.manager.load()
