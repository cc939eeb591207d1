"""Draft-model proposals: a smaller model of the same vocabulary guesses the next tokens.

Each request keeps the draft model's own KV cache (transformers' ``DynamicCache``) and the
tokens it covers; a proposal crops the cache to the longest prefix still true (the rejected
drafts drop out), feeds the tokens accepted since, and decodes ``k`` tokens greedily. Greedy
drafts are point masses, so the rejection sampler's rule (``speculative.verify``) is exact
for them as for n-gram drafts. The draft model runs one request at a time on the
scheduler's device, beside the paged KV pool (its memory is not counted in the pool's size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from services.scheduler.policy.req import Req


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    """``proposer.Proposer`` by a draft model (module docstring).

    Args:
        model_dir: the draft model (config.json, safetensors), loaded with transformers.
        vocab_size: the target model's vocabulary; the draft's must be the same.
        device: where it runs (the scheduler's device).

    Raises:
        ValueError: the draft's vocabulary size differs from the target's.
        FileNotFoundError: no config.json in ``model_dir``.
    """

    def __init__(self, model_dir: Path, vocab_size: int, device: torch.device):
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("vocab_size") != vocab_size:
            raise ValueError(f"--speculative-draft-model {model_dir}: vocabulary of {config.get('vocab_size')} tokens, "
                             f"the served model's has {vocab_size}; they must be the same")
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = device
        self._state: dict[Req, tuple[list[int], Any]] = {}  # tokens the cache covers, the cache

    @torch.inference_mode()
    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        return [self._propose(req, k) if k > 0 else [] for req, k in zip(reqs, limits, strict=True)]

    def _propose(self, req: Req, k: int) -> list[int]:
        ids = req.fill_ids()
        covered, cache = self._state.get(req, ([], None))
        keep = min(common_prefix(covered, ids), len(ids) - 1)  # the newest token is always fed
        if cache is not None and (drop := cache.get_seq_length() - keep) > 0:
            cache.crop(-drop)  # the rejected drafts (and tokens the target replaced)
        feed = ids[keep:]
        drafts: list[int] = []
        for _ in range(k):
            out = self.model(input_ids=torch.tensor([feed], device=self.device), cache=cache, use_cache=True)
            cache = out.cache
            token = int(out.logits[0, -1].argmax())
            drafts.append(token)
            feed = [token]
        self._state[req] = (ids + drafts[:-1], cache)
        return drafts

    def forget(self, req: Req) -> None:
        self._state.pop(req, None)
