"""Orchestration: the step that ties the host policy to the device executor.

- ``engine``: ``Engine.step``: plan (``policy``), launch (``executor``), then process the
  results (stops, frees, the prefix cache, the step's output rows), with overlap scheduling.
- ``loop``: ``EngineLoop``, the thread that drives an ``Engine``: its command queue,
  admission limits and output callback.
- ``observer``: the hooks the engine calls for each request's life cycle (metrics).

What goes here: the code that imports both ``policy`` and ``executor`` and decides the order
in which they run; nothing below it imports it. The service's modules (``main``,
``servicer``, ``wire``, ``metrics``) sit above it. vLLM's ``v1/engine/core.py``
(``EngineCore.step``) and mini-sglang's scheduler loop play this part.
"""
