"""The ring's internal credential: a shared secret on every internal gRPC link.

The scheduler's ``ringserve.v1.Scheduler`` (Connect, GetLoad) and the detokenizer's
``ringserve.v1.Detokenizer`` (Stream, Subscribe, GetLoad) are the ring's own: only its
tokenizers and schedulers call them. Each such call presents the ring's token as the
metadata ``ringserve-internal-token: <token>``, and those services refuse any call without
it, or with another, with UNAUTHENTICATED before the servicer runs
(``ringserve.grpc_auth``: checked once per call, so once per long-lived stream). gRPC
health and reflection stay open (probes). The public API key (``ringserve.apikeys``) is a
different credential on a different service: neither opens the other's door.

Where the token comes from: ``--internal-token-file FILE`` (e.g. a mounted Secret) or the
environment variable ``RINGSERVE_INTERNAL_TOKEN``, never a command line (``/proc/<pid>/cmdline``
is readable by every local user). ``ringserve launch`` generates one per ring with
``secrets.token_urlsafe`` (256 bits) unless one of those is given, and hands it to its
services in the environment; it is never logged or printed. Several tokens separated by
commas or whitespace are all accepted and the first is presented, so a token can be
rotated as an API key is. A service started alone with no token refuses to start, unless
``--insecure-skip-internal-auth`` says, loudly, that its internal port is open to anyone
who can reach it: generating a token there would lock out its peers, which could not know
it, and running open by default is what this module exists to prevent.

Mutual TLS (``--tls-*``, ``ringserve.grpcutil``) composes with it: TLS says which
certificate holder connected, the token that the caller belongs to this ring.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ringserve.apikeys import split_keys
from ringserve.grpc_auth import CredentialInterceptor, matches_any

INTERNAL_TOKEN_ENV = "RINGSERVE_INTERNAL_TOKEN"
METADATA_KEY = "ringserve-internal-token"
SKIP_FLAG = "--insecure-skip-internal-auth"

MISSING = f"missing internal credential: this service is for the ring's own services (metadata '{METADATA_KEY}')"
WRONG = "invalid internal credential"


@dataclass(frozen=True)
class InternalAuth:
    """The internal tokens a server accepts and the one this process presents.

    Attributes:
        tokens: every accepted token, in the order given; the first is presented. Empty:
            nothing is checked nor presented (``--insecure-skip-internal-auth``, or a
            service built in-process without one).
    """

    tokens: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(dict.fromkeys(self.tokens)))

    @classmethod
    def generate(cls) -> InternalAuth:
        """A fresh random token (``secrets.token_urlsafe(32)``: 256 bits, 43 URL-safe characters)."""
        return cls((secrets.token_urlsafe(32),))

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def __repr__(self) -> str:
        return f"InternalAuth({len(self.tokens)} token{'s' if len(self.tokens) != 1 else ''})"

    def accepts(self, value: str | None) -> bool:
        """Whether ``value`` (the metadata's) is one of the tokens, compared in constant time."""
        return not self.tokens or (value is not None and matches_any(value, self.tokens))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata presenting the first token; empty without tokens."""
        return ((METADATA_KEY, self.tokens[0]),) if self.tokens else ()

    def env(self) -> dict[str, str]:
        """``{RINGSERVE_INTERNAL_TOKEN: "t1,t2"}`` for a child process (``{}`` without tokens)."""
        return {INTERNAL_TOKEN_ENV: ",".join(self.tokens)} if self.tokens else {}

    def interceptors(self, *services: str) -> list[grpc.aio.ServerInterceptor]:
        """The server interceptors that require a token on ``services`` (none without tokens)."""
        return [InternalAuthInterceptor(self, services)] if self.tokens else []

    def log_state(self, log: logging.Logger, what: str) -> None:
        """Say at start-up whether ``what`` (e.g. "the Scheduler service on port 30020") checks
        the token; a WARNING when it does not. Never logs a token."""
        if self.tokens:
            log.info("%s requires the ring's internal credential", what)
        else:
            log.warning("%s checks no internal credential (%s): anyone who reaches the port can "
                        "read every output and abort every request", what, SKIP_FLAG)


class InternalAuthInterceptor(CredentialInterceptor):
    """Requires the internal token on every method of ``services``; others stay open."""

    def __init__(self, auth: InternalAuth, services: tuple[str, ...]) -> None:
        self.auth = auth
        super().__init__(services, METADATA_KEY, auth.accepts, MISSING, WRONG)


def add_internal_auth_args(parser: argparse.ArgumentParser, launcher: bool = False) -> None:
    """Add ``--internal-token-file`` and ``--insecure-skip-internal-auth``."""
    where = "default: $RINGSERVE_INTERNAL_TOKEN, else one generated for this ring" if launcher else \
        f"default: ${INTERNAL_TOKEN_ENV}; one of them (or {SKIP_FLAG}) is required"
    parser.add_argument("--internal-token-file", type=Path, default=None, metavar="FILE",
                        help=f"file holding the ring's internal credential, presented and required on the "
                             f"scheduler and detokenizer gRPC services ({where})")
    parser.add_argument(SKIP_FLAG, action="store_true",
                        help="INSECURE: internal gRPC services check no credential (anyone who can reach "
                             "their ports can read outputs and abort requests)")


def internal_auth_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            environ: Mapping[str, str] = os.environ, generate: bool = False) -> InternalAuth:
    """The ``InternalAuth`` of parsed ``add_internal_auth_args`` flags.

    Tokens come from ``--internal-token-file`` or else ``$RINGSERVE_INTERNAL_TOKEN``; with
    neither, a generated one when ``generate`` (the launcher), else a parser error (a
    service run alone). ``--insecure-skip-internal-auth`` gives an empty ``InternalAuth`` and
    is an error together with a file. A source that is given but holds no token, a file that
    cannot be read and a token that gRPC metadata cannot carry (not printable ASCII) are
    parser errors too. No error quotes a token.
    """
    if args.insecure_skip_internal_auth:
        if args.internal_token_file is not None:
            parser.error(f"--internal-token-file and {SKIP_FLAG} contradict each other")
        return InternalAuth()
    if args.internal_token_file is not None:
        try:
            text, source = args.internal_token_file.read_text(), f"--internal-token-file {args.internal_token_file}"
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"--internal-token-file {args.internal_token_file}: {getattr(exc, 'strerror', None) or exc}")
    elif INTERNAL_TOKEN_ENV in environ:
        text, source = environ[INTERNAL_TOKEN_ENV], f"${INTERNAL_TOKEN_ENV}"
    elif generate:
        return InternalAuth.generate()
    else:
        parser.error(f"no internal credential: set ${INTERNAL_TOKEN_ENV} or --internal-token-file to the ring's "
                     f"token (ringserve launch generates one), or pass {SKIP_FLAG} to run this service's port open")
    tokens = split_keys(text)
    if not tokens:
        parser.error(f"{source} holds no token")
    if not all(t.isascii() and t.isprintable() for t in tokens):
        parser.error(f"{source} holds a character that gRPC metadata cannot carry (printable ASCII only)")
    return InternalAuth(tokens)
