"""Prefill/decode disaggregation (docs/disaggregation.md).

A request's part is set per request by the tokenizer (``TokenizedGenerateReqInput``
``disagg_role``): the decode side reserves a request slot and KV rows for the prompt
(``handoff.DisaggState.reserve``), the prefill side runs the prompt, samples the first token
and hands both over (``handoff.DisaggState.take_prefilled``), the KV moves through a
``transfer.KvTransfer`` engine, and the decode side appends the first token and decodes on
(``handoff.DisaggState.commit``). ``service`` is the gRPC side: the decode scheduler's
``Disagg`` servicer and the prefill scheduler's sender.

Modules: ``roles`` (the role names), ``transfer`` (the engine interface and the ``grpc``
engine), ``mooncake`` (the ``mooncake`` engine: Mooncake's transfer engine, one-sided writes;
``mooncake_native`` loads it and the system libraries it links), ``engines`` (the engines by
name, ``--disaggregation-transfer-backend``),
``handoff`` (the engine-thread state of both sides), ``service`` (gRPC).
"""
