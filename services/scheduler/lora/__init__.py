"""Multi-LoRA: many fine-tunes of one base model served in the same batch.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adds
``x @ A^T @ B^T * scale`` to a linear's output, with A [r, in], B [out, r] and r small. The
modules here:

- ``adapter``: reads and checks an adapter in PEFT's format (``adapter_config.json`` and
  ``adapter_model.safetensors``) against the model's target modules, shapes and the rank
  limit;
- ``layers``: ``LoraLinear`` wraps a block's linear (qkv, o, gate/up, down) and adds each
  resident adapter's product to the rows of that adapter (grouped per adapter present in
  the step), holding this rank's shard of A and B as the base layer shards its weight;
- ``registry``: the resident set (names, slots, ``--max-loras``), the requests that use each
  adapter, the step's rows per adapter and the prefix cache's namespace per loaded adapter.
"""
