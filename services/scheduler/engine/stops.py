"""Stop decisions after each sampled token.

Sources of a stop, in the order checked (SGLang's ``Req.check_finished``, with stops
before length so a final EOS reports STOP):
  1. EOS ids: the tokenizer's ``eos_token`` plus ``generation_config.json``'s
     ``eos_token_id`` (int or list); skipped when ``ignore_eos``.
  2. ``stop_token_ids``.
  3. stop strings, matched on the decoded text of a bounded tail of the output ids, so a
     stop spanning token boundaries is found however it is tokenized. The scheduler only
     decodes; it never re-tokenizes text.
  4. ``max_new_tokens`` reached, or the context window full -> LENGTH.
Nothing but length stops a request before ``min_new_tokens`` outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.scheduler.engine.req import FinishReason, FinishType, Req

# Extra tokens decoded beyond the longest stop string: a character can take up to four
# byte-level tokens, and the window's first token may start mid-character.
_TAIL_SLACK = 8


def load_eos_ids(model_dir: Path, tokenizer: Tokenizer) -> frozenset[int]:
    """EOS ids of a model directory: tokenizer_config's eos_token and generation_config's eos_token_id.

    Falls back to config.json's eos_token_id when neither file names one.

    Raises:
        ValueError: no EOS id can be found at all.
    """
    ids: set[int] = set()
    tok_cfg_path = model_dir / "tokenizer_config.json"
    if tok_cfg_path.exists():
        eos = json.loads(tok_cfg_path.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            ids.add(tokenizer.token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists() and (not ids or name == "generation_config.json"):
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
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
                if not p.ignore_eos and last in self.eos_ids or last in p.stop_token_ids:
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
        windows = []
        for req in reqs:
            width = max(len(s) for s in req.sampling.stop) + _TAIL_SLACK
            out = req.output_ids
            windows.append(list(out[max(0, len(out) - width) :]))
        # Rows are grouped by skip_special_tokens so each group is one batched decode.
        for skip in (True, False):
            idx = [i for i, r in enumerate(reqs) if r.sampling.skip_special_tokens == skip]
            if not idx:
                continue
            texts = self.tokenizer.decode_batch([windows[i] for i in idx], skip_special_tokens=skip)
            for i, text in zip(idx, texts):
                req = reqs[i]
                hits = [(text.find(s), s) for s in req.sampling.stop if s in text]
                if hits:
                    # The earliest occurrence in the text is the one the client would see first.
                    req.finish_reason = FinishReason(FinishType.STOP, matched_str=min(hits)[1])
