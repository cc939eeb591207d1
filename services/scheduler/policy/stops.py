"""Stop decisions after each sampled token.

Sources of a stop, in the order checked (SGLang's ``Req.check_finished``, with stops
before length so a final EOS reports STOP):
  1. EOS ids: every id the model's files name as EOS (``ringserve.modelfacts``, the set
     the tokenizer reports); skipped when ``ignore_eos``.
  2. ``stop_token_ids`` (under a grammar only where the grammar may end: elsewhere the
     mask allowed the id as ordinary text, which must not cut a structured output).
  3. stop strings, matched on the decoded text of a bounded tail of the output ids, so a
     stop spanning token boundaries is found however it is tokenized. Only an occurrence
     that ends in the newest token's text counts (vLLM's ``check_stop_strings`` searches
     the new characters likewise): an older one was matched when it appeared, or appeared
     before ``min_new_tokens``, when stop strings do not apply. The scheduler only
     decodes; it never re-tokenizes text.
  4. ``max_new_tokens`` reached, or the context window full -> LENGTH.
Nothing but length stops a request before ``min_new_tokens`` outputs.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from ringserve.modelfacts import eos_token_ids
from services.scheduler.policy.req import FinishReason, FinishType, Req

# Every token decodes to at least one byte, so a stop string of B UTF-8 bytes lies within
# the last B tokens (a CJK character or an emoji takes 2-4 byte-level tokens: counting
# characters would miss it). The slack covers a window whose first token starts
# mid-character.
_TAIL_SLACK = 8
_REPLACEMENT = "\ufffd"


def load_eos_ids(model_dir: Path, tokenizer: Tokenizer) -> frozenset[int]:
    """The EOS ids of a model directory: ``ringserve.modelfacts.eos_token_ids``, the set the
    tokenizer service reports in ModelInfo (every id that tokenizer_config, config.json or
    generation_config names as EOS).

    Raises:
        ValueError: no file names an EOS id (nothing but length could end a request).
    """
    ids = eos_token_ids(model_dir, tokenizer.token_to_id)
    if not ids:
        raise ValueError(f"no EOS token id in {model_dir} (tokenizer_config, generation_config, config)")
    return frozenset(ids)


class StopChecker:
    """Sets ``finish_reason`` on requests whose latest token ends them."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int], context_length: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_length = context_length

    def check(self, reqs: list[Req]) -> None:
        """Check each request after its newest output token was appended."""
        string_rows: list[Req] = []
        for req in reqs:
            p = req.sampling
            out = req.output_ids
            if len(out) >= p.min_new_tokens:
                last = out[-1]
                if not p.ignore_eos and last in self.eos_ids or last in p.stop_token_ids and req.stop_ids_end_output:
                    req.finish_reason = FinishReason(FinishType.STOP, matched_token_id=last)
                    continue
                if p.stop:
                    string_rows.append(req)
            self._check_length(req)
        if string_rows:
            self._check_stop_strings(string_rows)

    def _check_length(self, req: Req) -> None:
        if len(req.output_ids) >= req.sampling.max_new_tokens or req.seq_len >= self.context_length:
            req.finish_reason = FinishReason(FinishType.LENGTH)

    def _check_stop_strings(self, reqs: list[Req]) -> None:
        """Finish the rows whose newest token completes a stop string.

        Each row's output tail is decoded twice, with and without the newest token (one
        batched decode per skip_special_tokens group); a stop string counts only where it
        ends past the complete text of the shorter window.
        """
        windows = []
        for req in reqs:
            width = max(len(s.encode()) for s in req.sampling.stop) + _TAIL_SLACK
            out = req.output_ids
            windows.append(list(out[max(0, len(out) - width) :]))
        for skip in (True, False):
            idx = [i for i, r in enumerate(reqs) if r.sampling.skip_special_tokens == skip]
            if not idx:
                continue
            texts = self.tokenizer.decode_batch(
                [windows[i] for i in idx] + [windows[i][:-1] for i in idx], skip_special_tokens=skip
            )
            for i, text, before in zip(idx, texts[: len(idx)], texts[len(idx) :], strict=True):
                req = reqs[i]
                # Trailing U+FFFD is an incomplete character that the newest token may complete.
                seen = len(before.rstrip(_REPLACEMENT))
                hits = [(at, s) for s in req.sampling.stop if (at := text.find(s, max(0, seen - len(s) + 1))) >= 0]
                if hits:
                    # The earliest occurrence in the text is the one the client would see first.
                    req.finish_reason = FinishReason(FinishType.STOP, matched_str=min(hits)[1])
