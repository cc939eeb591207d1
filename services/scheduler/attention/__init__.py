"""Attention over the paged KV cache: the per-step metadata and the backends that run it.

- ``paged``: ``AttnMetadata`` and the extend and decode layouts the model runner builds for
  each step; paged attention in torch (the ``torch`` backend's ops, and the reference the
  kernels are checked against).
- ``backends``: the ``AttentionBackend`` contract and its registry (``torch``, ``cpu``,
  ``triton``).

Why apart from ``layers``: attention is the one op of the model that reads per-step state
(the plan's KV rows through the req-to-token table) and has several implementations,
chosen when the model is built; the backends sit between the model's attention block
(``models.blocks.Attention``) and the kernels of ``kernels``. mini-sglang (``attention/``),
vLLM (``attention/backends``) and SGLang (``layers/attention/``) keep it apart too.
"""
