"""The tokenizer service: the public gRPC API and the entry of the ring.

It owns the tokenizer and chat template, renders and tokenizes requests,
validates sampling parameters against the context window, keeps one
``ReqState`` per in-flight rid, dispatches ``TokenizedGenerateReqInput`` and
``AbortReq`` to the scheduler, and routes the detokenizer's ``BatchStrOutput``
rows back to the waiting ``Generate`` call.

Modules: ``errors`` (request errors and their gRPC codes), ``chat`` (chat
rendering), ``sampling`` (parameter validation), ``manager`` (the network-free
core), ``links`` (scheduler and detokenizer connections), ``servicer`` (the
thin gRPC adapter), ``main`` (flags and start-up).
"""
