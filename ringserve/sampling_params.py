"""The sampling parameters: one table that every entry point builds from and validates against.

Each ``Param`` is one scalar field of the proto's ``SamplingParams`` (and, when ``resolved``,
of ``ResolvedSamplingParams``, the same name): its type, default, bounds and help.

- gateway: the pydantic fields of chat/completions (under their OpenAI names) and of
  ``/generate``'s ``sampling_params`` (under the proto's) are generated from ``TABLE``, so the
  OpenAPI schema shows the bounds; the conversion to the proto copies every field by name.
- tokenizer: checks what every client sent (through the gateway or straight over gRPC) and
  fills in the defaults.
- scheduler: its ``SamplingParams`` is made from the resolved rows and copied off the wire by
  name; its last-line-of-defence validation checks the same bounds.

A value is refused everywhere with ``violation``'s message ("temperature must be at most 2,
got 3"), the gateway's pydantic bound errors included (``bound_message``).

Adding a parameter: the proto field (in both messages), a row here, the sampler's
implementation and its test.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

Number = int | float

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Param:
    """One sampling parameter.

    Attributes:
        name: the proto field (SamplingParams, ResolvedSamplingParams) and ``/generate``'s name.
        type: bool, int or float.
        default: what the tokenizer fills in when the client gives nothing; None when there is
            no constant default (max_new_tokens: what the context window leaves; seed: none).
        help: one line for the OpenAPI schema and the docs.
        lo / hi: the bounds (None: unbounded on that side); ``lo_open`` / ``hi_open`` make a
            bound exclusive.
        off: one value below ``lo`` that turns the parameter off (top_k's -1). A schema
            cannot state "-1 or at least 1": the gateway's field takes ``off`` as its
            minimum and the conversion checks the gap with ``violation``.
        http: the OpenAI name in chat/completions when it differs (max_new_tokens ->
            max_tokens).
        resolved: sent to the scheduler in ResolvedSamplingParams (``n`` is expanded by the
            tokenizer instead).
    """

    name: str
    type: type
    default: bool | int | float | None
    help: str
    lo: Number | None = None
    hi: Number | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: Number | None = None
    http: str | None = None
    resolved: bool = True

    @property
    def http_name(self) -> str:
        """The name of the field in an OpenAI chat or completions request."""
        return self.http or self.name

    def range_text(self) -> str:
        """The accepted values in interval notation (``[0, 2]``, ``-1 or [1, 2147483647]``)."""
        if self.type is bool:
            return "true or false"
        lo = "(-inf" if self.lo is None else ("(" if self.lo_open else "[") + _number(self.lo)
        hi = "inf)" if self.hi is None else _number(self.hi) + (")" if self.hi_open else "]")
        return (f"{_number(self.off)} or " if self.off is not None else "") + f"{lo}, {hi}"


TABLE: tuple[Param, ...] = (
    Param("temperature", float, 1.0, "Divides the logits before sampling; 0 is greedy.", lo=0, hi=2),
    Param("top_p", float, 1.0, "Nucleus sampling: keep the most likely tokens whose mass reaches top_p.",
          lo=0, hi=1, lo_open=True),
    Param("top_k", int, -1, "Keep the k most likely tokens; -1 keeps all.", lo=1, hi=INT32_MAX, off=-1),
    Param("min_p", float, 0.0, "Drop tokens less likely than min_p times the most likely one.", lo=0, hi=1),
    Param("typical_p", float, 1.0, "Locally typical sampling: keep the tokens whose surprisal is closest to the "
          "entropy until their mass reaches typical_p; 1 is off.", lo=0, hi=1, lo_open=True),
    Param("max_new_tokens", int, None, "Most tokens to generate; default: what the context window leaves.",
          lo=1, hi=INT32_MAX, http="max_tokens"),
    Param("min_new_tokens", int, 0, "Fewest tokens to generate before EOS or a stop token may end the output.",
          lo=0, hi=INT32_MAX, http="min_tokens"),
    Param("ignore_eos", bool, False, "Keep generating past the model's EOS tokens."),
    Param("skip_special_tokens", bool, True, "Leave special tokens out of the text."),
    Param("spaces_between_special_tokens", bool, True, "Put spaces between special tokens in the text."),
    Param("no_stop_trim", bool, False, "Keep the matched stop string or token in the text."),
    Param("seed", int, None, "Seed of the request's own random generator (reproducible sampling).",
          lo=0, hi=2**64, hi_open=True),
    Param("presence_penalty", float, 0.0, "Subtracted from the logit of every token already in the output.",
          lo=-2, hi=2),
    Param("frequency_penalty", float, 0.0, "Subtracted from a token's logit once per time it is in the output.",
          lo=-2, hi=2),
    Param("repetition_penalty", float, 1.0, "Divides positive (multiplies negative) logits of tokens in the "
          "prompt or output; 1 is off.", lo=0, hi=2, lo_open=True),
    Param("n", int, 1, "Choices to generate for the prompt.", lo=1, hi=128, resolved=False),
)
PARAMS: dict[str, Param] = {p.name: p for p in TABLE}
RESOLVED: tuple[Param, ...] = tuple(p for p in TABLE if p.resolved)

# Not fields of SamplingParams, but bounded alike: a logit_bias value, and the top logprobs per
# token (the request's top_logprobs_num, OpenAI's top_logprobs / completions' logprobs).
LOGIT_BIAS = Param("logit_bias", float, None, "Added to the logit of its token id.", lo=-100, hi=100)
TOP_LOGPROBS = Param("top_logprobs_num", int, 0, "Most likely tokens returned with each token's logprob.",
                     lo=0, hi=20, http="top_logprobs")


def resolved_defaults() -> dict[str, bool | int | float]:
    """The constant default of every resolved parameter, by name: what the tokenizer fills in
    (max_new_tokens and seed have none), for code that builds a ResolvedSamplingParams itself."""
    return {p.name: p.default for p in RESOLVED if p.default is not None}


def _float32_text(value: float) -> str | None:
    """The shortest spelling of ``value`` when it is a float32 (what a proto float carries), else None."""
    try:
        packed = struct.pack("<f", value)
    except OverflowError:
        return None
    if struct.unpack("<f", packed)[0] != value:
        return None
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == value:
            return text
    return None


def _number(value: Number) -> str:
    """A number as a message shows it: 3 (not 3.0), 2.1 for the float32 nearest 2.1."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return _float32_text(value) or repr(value)


def _got(value: object) -> str:
    # A negative value is never echoed: a client reading "max_tokens ... -5" could not tell
    # whether it sent -5 or the server computed it.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a negative value" if value < 0 else _number(value)
    return repr(value)


def bound_message(path: str, words: str, bound: Number, value: object) -> str:
    """The refusal of a value outside a bound: "``path`` must be ``words`` ``bound``, got ``value``".

    ``words`` is "at least", "greater than", "at most" or "less than". NaN and infinities
    are refused as such ("must be a finite number"), whichever bound they failed; a negative
    value is never echoed ("got a negative value").
    """
    if isinstance(value, float) and not math.isfinite(value):
        return _not_finite(path, value)
    return f"{path} must be {words} {_number(bound)}, got {_got(value)}"


def _not_finite(path: str, value: float) -> str:
    return f"{path} must be a finite number, got {value}"


def violation(p: Param, value: Number, path: str | None = None) -> str | None:
    """Why ``value`` is not a valid ``p``, or None when it is.

    Args:
        p: the parameter.
        value: its value (a bool for bool parameters, which have no bounds).
        path: where the client wrote it, for the message (default ``p.name``).

    Returns:
        The message every entry point refuses it with: NaN and infinities ("must be a finite
        number"), a value outside the bounds (``bound_message``); for a parameter with an
        ``off`` value, any other value below ``lo`` ("must be -1 (disabled) or at least 1").
    """
    if p.type is bool:
        return None
    path = path or p.name
    if isinstance(value, float) and not math.isfinite(value):
        return _not_finite(path, value)
    if p.off is not None and value == p.off:
        return None
    if p.lo is not None and (value <= p.lo if p.lo_open else value < p.lo):
        words = "greater than" if p.lo_open else "at least"
        if p.off is not None:
            return f"{path} must be {_number(p.off)} (disabled) or {words} {_number(p.lo)}, got {_got(value)}"
        return bound_message(path, words, p.lo, value)
    if p.hi is not None and (value >= p.hi if p.hi_open else value > p.hi):
        return bound_message(path, "less than" if p.hi_open else "at most", p.hi, value)
    return None


def markdown() -> str:
    """The table as Markdown (name, OpenAI name, type, default, range, help), for the docs."""
    rows = ["| parameter | OpenAI name | type | default | range | what it does |", "|---|---|---|---|---|---|"]
    for p in TABLE:
        default = "—" if p.default is None else str(p.default).lower() if p.type is bool else _number(p.default)
        rows.append(f"| `{p.name}` | `{p.http_name}` | {p.type.__name__} | {default} | {p.range_text()} | {p.help} |")
    return "\n".join(rows)
