"""Grammar engines behind one small interface: compile a constraint, then per request a matcher
that fills a token bitmask, accepts tokens and says when the grammar has ended.

Two well-kept engines, chosen with ``--grammar-backend`` (figures in bench/RESULTS.md,
measured with bench/grammar_backends.py on SmolLM2's 49,152-token vocabulary):

- ``llguidance`` (default; Microsoft's guidance, an Earley parser over a token trie that
  computes each mask lazily): a JSON-schema grammar is ready in about a millisecond
  whatever its nesting (a nested-``anyOf`` schema of depth 12 in 0.6 s), masks in 17-33 us
  per token.
- ``xgrammar`` (MLC's pushdown automaton with an adaptive token-mask cache): masks in
  3-21 us per token, but compiles ahead of time, which grew to 10 s for a nested
  ``oneOf`` schema of depth 8 and 223 s at depth 12 (its compile cannot be interrupted:
  the compile budget only stops the request from waiting for it). It would ignore or
  approximate some keywords (a non-disjoint ``oneOf`` by ``anyOf``).

Both compile a JSON schema as ``ringserve.schema_rewrite`` puts it, the function the
tokenizer validates with: a provably exclusive ``oneOf`` as ``anyOf``, unknown ``format``s
dropped (annotations), and the keywords neither enforces refused by name and JSON Pointer.

Both cap the whitespace a JSON grammar allows between tokens, so a JSON mode never loops
on blanks. Errors: ``GrammarError`` with a message for the client at compile time; later a
matcher reports its engine's error state through ``Matcher.error`` (llguidance enters one
when a grammar exceeds its parser or lexer limits, e.g. a rule of more than 2,000
alternatives or a regex counting to 300,000), which the engine checks after every mask.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ringserve.options import names
from ringserve.schema_rewrite import REFUSED_KEYWORDS, pointer_token, rewrite_schema

# Whitespace allowed between JSON tokens: enough for indented output, never an endless run.
JSON_WHITESPACE_MAX = 16


_NON_VERBOSE = "<non-verbose/>"  # llguidance's marker where verbose_errors would dump its state


class GrammarError(ValueError):
    """A constraint the backend cannot compile; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: ``kind`` is "json_schema", "regex" or "ebnf"; ``param`` the request
    field; ``starts_after`` the token ids after which the grammar applies (a reasoning end
    tag; empty = from the first token) and ``opens_with`` the reasoning's opening tag (the
    output is reasoning only when it opens with it; empty = reasoning from the first token);
    see ``policy.grammar_gate``. Neither is part of what is compiled."""

    kind: str
    text: str
    param: str = "response_format"
    starts_after: tuple[int, ...] = ()
    opens_with: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text


class Matcher(Protocol):
    """One request's grammar state."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [B, ceil(V/32)], bit set = allowed)."""
        ...

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding's rejected drafts)."""
        ...

    @property
    def ended(self) -> bool:
        """The grammar is complete and nothing can follow (or a stop token was accepted)."""
        ...

    @property
    def may_end(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may end here)."""
        ...

    @property
    def error(self) -> str | None:
        """The engine's error state (a limit exceeded, a token it could not take), else None."""
        ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int
    eos_ids: frozenset[int]

    def compile(self, spec: GrammarSpec) -> Any:
        """Compile ``spec`` (called off the engine thread). Raises GrammarError."""
        ...

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher over a compiled grammar (engine thread; cheap)."""
        ...


def _hf_tokenizer(model_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))


class LLGuidanceMatcher:
    def __init__(self, matcher: Any):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    @property
    def ended(self) -> bool:
        return bool(self._m.is_stopped()) and not self._m.is_error()  # it also stops on an error

    @property
    def may_end(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        if not self._m.is_error():
            return None
        return self._m.get_error().replace(_NON_VERBOSE, "").strip() or "error state"


class LLGuidanceBackend:
    """llguidance: JSON schema, regex and GBNF (converted to its Lark dialect)."""

    name = "llguidance"

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: frozenset[int]):
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self.tokenizer = llguidance.hf.from_tokenizer(_hf_tokenizer(model_dir), n_vocab=vocab_size,
                                                      eos_token=sorted(eos_ids))
        # Its default limits; errors without the parser-state dump (it quotes the grammar).
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile(self, spec: GrammarSpec) -> Any:
        llg = self._llg
        try:
            if spec.kind == "json_schema":
                options = {"whitespace_flexible": True, "whitespace_pattern": f"[ \\n\\t]{{0,{JSON_WHITESPACE_MAX}}}"}
                grammar = llg.LLMatcher.grammar_from_json_schema(rewrite_schema(spec.text), options)
            elif spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.text)
            elif spec.kind == "ebnf":
                grammar = llg.grammar_from("gbnf", spec.text)
            else:
                raise GrammarError(f"unknown constraint kind {spec.kind!r}")
        except GrammarError:
            raise
        except Exception as exc:  # the engine's verdict on the client's grammar, whatever its type
            raise GrammarError(str(exc) or type(exc).__name__) from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        if failed:
            raise GrammarError("; ".join(messages))
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher  # a template: each request gets a deep copy

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy())


class XGrammarMatcher:
    def __init__(self, matcher: Any):
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    @property
    def ended(self) -> bool:
        return bool(self._m.is_terminated())

    @property
    def may_end(self) -> bool:
        return bool(self._m.is_completed())

    @property
    def error(self) -> str | None:
        return None  # no error state: a rejected token is accept_token's False, a dead end an empty mask


class XGrammarBackend:
    """xgrammar: JSON schema, regex and its EBNF (GBNF-compatible)."""

    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: frozenset[int]):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        info = xgrammar.TokenizerInfo.from_huggingface(_hf_tokenizer(model_dir), vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_ids))
        # Our own LRU caches compiled grammars (services/scheduler/policy/grammar.py).
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                text = rewrite_schema(spec.text)
                _refuse_left_over(json.loads(text))
                return self.compiler.compile_json_schema(text, strict_mode=False, any_whitespace=True,
                                                         max_whitespace_cnt=JSON_WHITESPACE_MAX)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.text)
        except GrammarError:
            raise
        except Exception as exc:  # the engine's verdict on the client's grammar, whatever its type
            raise GrammarError(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__) from None
        raise GrammarError(f"unknown constraint kind {spec.kind!r}")

    def matcher(self, compiled: Any) -> Matcher:
        # Stop tokens are allowed wherever the grammar may end, and accepting one ends it (its
        # terminate_without_stop_token would forbid ending "ab" under "ab(c)?", forcing the "c").
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


def _refuse_left_over(schema: Any) -> None:
    """Raise GrammarError naming a keyword xgrammar would approximate that the rewrite left in
    place: one it does not reach (a ``$ref`` it cannot follow, an unreferenced ``$defs``
    entry) is refused anywhere in the document, ``oneOf`` included, as xgrammar might compile it."""
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, pointer = todo.pop()
        if isinstance(node, list):
            todo.extend((v, f"{pointer}/{i}") for i, v in enumerate(node))
        elif isinstance(node, dict):
            key = next((k for k in ("oneOf", *REFUSED_KEYWORDS) if k in node), None)
            if key is not None:
                raise GrammarError(f"{key} at {pointer or '(root)'} is not supported by the xgrammar backend")
            for name, value in node.items():
                at = f"{pointer}/{pointer_token(name)}"
                if name in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
                    todo.extend((sub, f"{at}/{pointer_token(k)}") for k, sub in value.items())  # keys are names here
                elif name not in ("const", "enum", "default", "examples"):  # JSON data, not schemas
                    todo.append((value, at))


GRAMMAR_BACKENDS: dict[str, Callable[[Path, int, frozenset[int]], GrammarBackend]] = {
    "llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}
names.check_registry("grammar backend", GRAMMAR_BACKENDS, names.GRAMMAR_BACKENDS)


def load_backend(name: str, model_dir: Path, vocab_size: int, eos_ids: frozenset[int]) -> GrammarBackend:
    """The backend ``name`` for a model directory (reads its tokenizer.json).

    ``eos_ids`` end a grammar: the model's EOS set (``ringserve.modelfacts.eos_token_ids``),
    the same the scheduler stops on and the tokenizer reports, so a grammar can end on any
    id that ends the output.

    Raises:
        ValueError: a name outside GRAMMAR_BACKENDS, or its package is not installed.
    """
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")
    if importlib.util.find_spec(name) is None:
        raise ValueError(f"--grammar-backend {name} needs the {name} package: pip install 'ringserve[{name}]'")
    return GRAMMAR_BACKENDS[name](model_dir, vocab_size, eos_ids)
