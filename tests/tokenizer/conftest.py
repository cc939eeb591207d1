"""Fixtures for the tokenizer service's tests: the real SmolLM2 tokenizer and a recording dispatcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve.v1 import scheduler_pb2
from services.tokenizer.bounds import InputBounds
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.model import load_tokenizer, model_facts


class RecordingDispatcher:
    """A Dispatcher that records what would go to the scheduler; ``down`` makes it refuse like a lost link."""

    def __init__(self) -> None:
        self.reqs: list[scheduler_pb2.TokenizedGenerateReqInput] = []
        self.aborts: list[scheduler_pb2.AbortReq] = []
        self.down = False
        self.schedule_policy: str | None = None  # as a scheduler reports it; None: not yet reported

    def _check(self) -> None:
        if self.down:
            from services.tokenizer.errors import unavailable

            raise unavailable("the scheduler is not connected")

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        self._check()
        self.reqs.append(req)

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None:
        self._check()
        self.aborts.append(abort)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_bounds(smollm2_dir: Path, smollm2_tokenizer) -> InputBounds:
    """SmolLM2's input bounds, derived once (reading the vocabulary takes ~0.1 s)."""
    return InputBounds.of(smollm2_tokenizer, model_facts(smollm2_dir, smollm2_tokenizer))[0]


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()


@pytest.fixture
def manager(smollm2_dir: Path, smollm2_tokenizer, smollm2_bounds, dispatcher: RecordingDispatcher) -> TokenizerManager:
    facts = model_facts(smollm2_dir, smollm2_tokenizer)
    return TokenizerManager(smollm2_tokenizer, facts, "tok-test", dispatcher, bounds=smollm2_bounds)
