"""API keys: where they come from, how a request presents one, and the gRPC check.

One set of keys protects both public surfaces: the gateway's HTTP API and the tokenizer's
``ringserve.v1.Tokenizer`` gRPC service. A client presents a key as
``Authorization: Bearer <key>`` (an HTTP header, or gRPC metadata ``authorization``,
RFC 6750 §2.1). Several keys may be valid at once, so that a key can be rotated: add the
new key, move the clients over, drop the old one.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (a file, e.g. a mounted
Secret) and the environment variable ``RINGSERVE_API_KEY``; all that are given count.
Each source may hold several keys separated by commas or whitespace (an RFC 6750 token
holds neither). A source that is given but holds no key is an error rather than "no
auth". Keys are never logged: ``ApiKeys``'s repr shows only how many there are, and
``ringserve launch`` hands them to its services through the environment, not the
command line (``/proc/<pid>/cmdline`` is readable by every local user).

Internal links (tokenizer -> scheduler, detokenizer) carry the ring's own credential instead
(``ringserve.internal_auth``), never an API key.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.grpc_auth import CredentialInterceptor, matches_any

API_KEY_ENV = "RINGSERVE_API_KEY"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
_SEPARATORS = re.compile(r"[,\s]+")

MISSING = "missing API key: send the metadata 'authorization: Bearer <key>'"
WRONG = "invalid API key"


def split_keys(text: str) -> tuple[str, ...]:
    """The keys in ``text``: separated by commas or whitespace; empty pieces dropped."""
    return tuple(k for k in _SEPARATORS.split(text) if k)


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts (empty: no key needed) and the one this process presents.

    Attributes:
        keys: every accepted key, in the order given; the first is the one this process
            presents to the services it calls (the gateway to the tokenizer).
    """

    keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(dict.fromkeys(self.keys)))  # drop duplicates, keep order

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.keys)} key{'s' if len(self.keys) != 1 else ''})"

    def accepts(self, authorization: str | None) -> bool:
        """Whether ``authorization`` (an ``Authorization`` header or metadata value) is
        ``Bearer <key>`` for one of the keys (the scheme is case-insensitive, RFC 7235).
        Every key is compared in constant time."""
        if not self.keys:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return matches_any(token.strip(), self.keys)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata that presents the first key; empty without keys."""
        return ((METADATA_KEY, f"Bearer {self.keys[0]}"),) if self.keys else ()

    def env(self) -> dict[str, str]:
        """``{RINGSERVE_API_KEY: "k1,k2"}`` for a child process (``{}`` without keys)."""
        return {API_KEY_ENV: ",".join(self.keys)} if self.keys else {}


def add_api_key_args(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--api-key`` and ``--api-key-file``; ``what`` names the protected surface in the help."""
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer <key>' on {what}; repeat (or separate by "
                             f"commas) for several valid keys; also read from ${API_KEY_ENV}")
    parser.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                        help="file holding valid API keys (separated by newlines or commas), e.g. a mounted Secret")


def api_keys_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       environ: Mapping[str, str] = os.environ) -> ApiKeys:
    """The union of the keys of ``--api-key``, ``--api-key-file`` and ``$RINGSERVE_API_KEY``.

    A source that is given but holds no key is a parser error (an empty Secret must not
    turn authentication off); so is a file that cannot be read. The error never quotes a key.
    """
    keys: list[str] = []
    for value in args.api_key:
        if not split_keys(value):
            parser.error("--api-key is empty")
        keys += split_keys(value)
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text()
        except OSError as exc:
            parser.error(f"--api-key-file {args.api_key_file}: {exc.strerror}")
        if not split_keys(text):
            parser.error(f"--api-key-file {args.api_key_file} holds no key")
        keys += split_keys(text)
    if API_KEY_ENV in environ:
        if not split_keys(environ[API_KEY_ENV]):
            parser.error(f"${API_KEY_ENV} is set but holds no key")
        keys += split_keys(environ[API_KEY_ENV])
    return ApiKeys(tuple(keys))


class ApiKeyInterceptor(CredentialInterceptor):
    """Requires a valid key on every method of the named services; others (health,
    reflection) stay open, as the HTTP probes do. A missing or wrong key ends the call
    with UNAUTHENTICATED before the servicer runs (``ringserve.grpc_auth``)."""

    def __init__(self, keys: ApiKeys, services: tuple[str, ...]) -> None:
        self.keys = keys
        super().__init__(services, METADATA_KEY, keys.accepts, MISSING, WRONG)
