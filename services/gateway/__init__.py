"""The OpenAI-compatible HTTP gateway: FastAPI in front of the tokenizer's gRPC ``Generate``.

Stateless: it validates OpenAI requests, turns them into ``GenerateReqInput``, and frames
the ``GenerateOutput`` stream as SSE or one JSON body. No torch, no model files.
"""
