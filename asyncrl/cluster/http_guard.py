"""Who may call the run's HTTP surfaces (the dashboard page and its API, the OpenAI-compatible endpoint): one
check, shared by both servers, against cross-site pages, DNS rebinding and callers without the secret.

- Host: a request's `Host` must name the server (the address it is bound to, this machine's name, or, bound to
  loopback, a loopback name). A page of a rebinding domain reaches 127.0.0.1 with `Host: evil.example` and is
  refused. Bound to a wildcard address (0.0.0.0, ::) any name is accepted: the secret carries the check there.
- Origin: a request that carries `Origin` (a browser's fetch does) must come from the server's own origin.
- Secret: `Authorization: Bearer SECRET` (or `?token=SECRET`, for opening the page), compared in constant time.
- Content type: a state-changing call must be `application/json`; a cross-site form or "simple" fetch cannot
  send that (nor an `Authorization` header) without a CORS preflight, which these servers never grant.

docs/security.md describes what each surface enforces and what it does not.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
DASHBOARD_TOKEN_ENV = "ASYNCRL_DASHBOARD_TOKEN"
"""Environment variable read when `telemetry.dashboard_token` is empty."""
OPENAI_API_KEY_ENV = "ASYNCRL_OPENAI_API_KEY"
"""Environment variable read when `rollout.openai_api_key` is empty."""


class Headers(Protocol):
    """A request's header map, case-insensitive (http.server's `Message`, aiohttp's `CIMultiDictProxy`)."""

    def get(self, name: str, /) -> str | None: ...


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP addresses (127.0.0.0/8, ::1); False for every other name."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secret(configured: str, env: str) -> str:
    """The configured secret, else the environment variable `env`'s value ("" when neither is set)."""
    return configured or os.environ.get(env, "")


def new_token() -> str:
    """A fresh random token (32 url-safe characters, 192 bits)."""
    return secrets.token_urlsafe(24)


def beyond_loopback_error(key: str, env: str, host_key: str, host: str) -> str:
    """The message of a bind beyond loopback without a secret (config validation and the servers use it)."""
    return (
        f"{host_key}={host} serves beyond this machine: set {key} (or the environment variable {env}) "
        f"to a secret its callers send, or bind {host_key} to 127.0.0.1"
    )


def host_name(header: str) -> str:
    """The name part of a `Host` header (`[::1]:8470` -> `::1`, `Example:80` -> `example`)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class Guard:
    """The checks of one server bound to `bind_host`; `token` "" = no secret asked (loopback OpenAI endpoint)."""

    bind_host: str
    token: str

    def __post_init__(self) -> None:
        if not is_loopback(self.bind_host) and not self.token:
            raise ValueError(f"a server bound to {self.bind_host} (beyond loopback) needs a secret")

    def known_hosts(self) -> frozenset[str] | None:
        """The names a `Host` header may carry; None = any (a wildcard bind)."""
        if self.bind_host in WILDCARD_HOSTS:
            return None
        names = {self.bind_host.lower().strip("[]")}
        if is_loopback(self.bind_host):
            return frozenset(names | LOOPBACK_NAMES)
        return frozenset(names | {socket.gethostname().lower(), socket.getfqdn().lower()})

    def refusal(self, method: str, headers: Headers, query_token: str | None = None) -> tuple[HTTPStatus, str] | None:
        """(status, message) when the request must be refused, None when it may go on."""
        host = headers.get("Host")
        known = self.known_hosts()
        if not host:
            return HTTPStatus.BAD_REQUEST, "the request has no Host header"
        if known is not None and host_name(host) not in known:
            return HTTPStatus.FORBIDDEN, (
                f"Host {host!r} does not name this server (a DNS-rebinding page?): use one of {sorted(known)}"
            )
        origin = headers.get("Origin")
        if origin is not None and not _same_origin(origin, host):
            return HTTPStatus.FORBIDDEN, f"Origin {origin!r} is not this server's page: cross-site calls are refused"
        if self.token and not self._authorized(headers.get("Authorization"), query_token):
            return HTTPStatus.UNAUTHORIZED, (
                "missing or wrong token: send 'Authorization: Bearer TOKEN' (the page's address printed at start "
                "carries it as ?token=TOKEN)"
            )
        if method not in ("GET", "HEAD"):
            kind = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, (
                    f"Content-Type {kind or 'missing'!s}: a {method} here must be application/json"
                )
        return None

    def _authorized(self, authorization: str | None, query_token: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        offered = given.strip() if scheme.lower() == "bearer" else (query_token or "")
        return hmac.compare_digest(offered.encode("utf-8", "replace"), self.token.encode())


def _same_origin(origin: str, host: str) -> bool:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()
