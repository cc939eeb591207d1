"""The speculator the engine's config asks for (``--speculative-algorithm``)."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.config import EngineConfig
from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import Sampler
from services.scheduler.policy.req import Req
from services.scheduler.speculative.ngram import NgramProposer
from services.scheduler.speculative.speculator import Speculator


def build_speculator(cfg: EngineConfig, sampler: Sampler, runtime: DeviceRuntime, context_length: int,
                     one_at_a_time: Callable[[Req], bool], vocab_size: int) -> Speculator | None:
    """The speculator of ``cfg`` (None for ``none``).

    Raises:
        ValueError: ngram match sizes out of order; ``draft`` (its proposer is not built yet).
    """
    algorithm = cfg.speculative_algorithm
    if algorithm == "none":
        return None
    if algorithm == "ngram":
        proposer = NgramProposer(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
    else:
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported yet; use ngram")
    return Speculator(proposer, sampler, runtime, cfg.speculative_num_draft_tokens, context_length, one_at_a_time,
                      vocab_size)
