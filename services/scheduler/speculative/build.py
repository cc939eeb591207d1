"""The speculator the engine's config asks for (``--speculative-algorithm``)."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.config import EngineConfig
from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import Sampler
from services.scheduler.policy.req import Req
from services.scheduler.speculative.draft_model import DraftModelProposer
from services.scheduler.speculative.ngram import NgramProposer
from services.scheduler.speculative.proposer import Proposer
from services.scheduler.speculative.speculator import Speculator


def build_speculator(cfg: EngineConfig, sampler: Sampler, runtime: DeviceRuntime, context_length: int,
                     one_at_a_time: Callable[[Req], bool], vocab_size: int) -> Speculator | None:
    """The speculator of ``cfg`` (None for ``none``).

    Raises:
        ValueError: ngram match sizes out of order; ``draft`` without a draft model, or one of
            another vocabulary size.
    """
    algorithm = cfg.speculative_algorithm
    proposer: Proposer
    if algorithm == "none":
        return None
    if algorithm == "ngram":
        proposer = NgramProposer(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
    elif cfg.speculative_draft_model is None:
        raise ValueError("--speculative-algorithm draft needs --speculative-draft-model PATH")
    else:
        proposer = DraftModelProposer(cfg.speculative_draft_model, vocab_size, runtime.device)
    return Speculator(proposer, sampler, runtime, cfg.speculative_num_draft_tokens, context_length, one_at_a_time,
                      vocab_size)
