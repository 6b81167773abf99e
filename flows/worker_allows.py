"""What a worker lets a spec read back from the store take from it: the environment variables its
`${VAR}` may fill and its endpoints' `api_key_env` may name (POSTTRAIN_ALLOWED_VARIABLES), and the
hosts its endpoints may be (POSTTRAIN_ALLOWED_ENDPOINTS).

Whoever can write to the store can keep a spec of their own there and point a checkpoint at it; an
evaluation of that checkpoint (triggered, or `posttrain eval REF`) reads the spec back. Filled from
the worker's whole environment, it could put any secret in a judge's URL, or name it as the judge's
key, and send it anywhere. So a stored spec gets only what the worker's own environment allows;
nothing while the variables are unset. The spec a run's author gives is not checked (flows/spec.py).

Both variables are lists separated by spaces or commas. POSTTRAIN_ALLOWED_VARIABLES holds names
(`S3_ENDPOINT_URL POSTTRAIN_BUCKET`); POSTTRAIN_ALLOWED_ENDPOINTS holds `host`, `host:port`,
`*.domain` or `*.domain:port` (`judge.internal:8000 *.openai.azure.com`): without a port any port of
the host, `*.` any host under the domain.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from flows.placeholders import dotted

VARIABLES = "POSTTRAIN_ALLOWED_VARIABLES"
ENDPOINTS = "POSTTRAIN_ALLOWED_ENDPOINTS"
# a URL's authority as a client and urlsplit read it alike: a host (or [IPv6]) and a port, no user
# info, no backslash or other character a client may take as the end of the host
PLAIN_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
DEFAULT_PORTS = {"http": 80, "https": 443}


class NotAllowed(ValueError):
    """str() is one line naming the field and the variable that would allow it."""


@dataclass(frozen=True)
class WorkerAllows:
    variables: frozenset[str] = frozenset()
    endpoints: tuple[tuple[str, int | None], ...] = ()  # (host or *.domain, port or None: any)

    @classmethod
    def from_environ(cls, environ=os.environ) -> WorkerAllows:
        return cls(frozenset(listed(environ, VARIABLES)), tuple(endpoint_entry(e) for e in listed(environ, ENDPOINTS)))

    def check_variable(self, path: tuple, name: str) -> None:
        if name not in self.variables:
            raise NotAllowed(f"{dotted(path)}: variable {name} is not in {VARIABLES} (a spec read from the store "
                             "takes only the variables this worker allows)")

    def check_endpoint(self, path: tuple, url: str) -> None:
        where = host_and_port(url)
        if where is None:
            raise NotAllowed(f"{dotted(path)}: not an http(s) URL with a plain host[:port] (a spec read from the "
                             "store talks only to the endpoints this worker allows)")
        if not any(covers(entry, *where) for entry in self.endpoints):
            raise NotAllowed(f"{dotted(path)}: host {where[0]}:{where[1]} is not in {ENDPOINTS} (a spec read from "
                             "the store talks only to the endpoints this worker allows)")

    def check_endpoints(self, document, path: tuple = ()) -> None:
        """Every endpoint in the (filled) spec document: its `endpoint` URL's host, its `api_key_env`
        (teachers, judges, rollout servers, a dataset env's judge rewards: every mapping with those keys)."""
        items = document.items() if isinstance(document, dict) else enumerate(document) \
            if isinstance(document, list) else ()
        for key, value in items:
            if key == "endpoint" and isinstance(value, str):
                self.check_endpoint((*path, key), value)
            elif key == "api_key_env" and isinstance(value, str):
                self.check_variable((*path, key), value)
            else:
                self.check_endpoints(value, (*path, key))


def listed(environ, variable: str) -> list[str]:
    return [entry for entry in environ.get(variable, "").replace(",", " ").split() if entry]


def endpoint_entry(entry: str) -> tuple[str, int | None]:
    """(host, port or None) of a POSTTRAIN_ALLOWED_ENDPOINTS entry."""
    host = entry.removeprefix("*.")
    if not PLAIN_AUTHORITY.fullmatch(host):
        raise NotAllowed(f"{ENDPOINTS}: {entry!r} is not host[:port] (or *.domain[:port])")
    try:
        parts = urlsplit("//" + host)
        return entry[:len(entry) - len(host)] + (parts.hostname or ""), parts.port
    except ValueError:  # a port out of range
        raise NotAllowed(f"{ENDPOINTS}: {entry!r} has no valid port") from None


def host_and_port(url: str) -> tuple[str, int] | None:
    """(host, port) a client sends a request for `url` to; None when the URL is not plainly one."""
    try:
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS or not PLAIN_AUTHORITY.fullmatch(parts.netloc) or not parts.hostname:
            return None
        return parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:  # a port out of range
        return None


def covers(entry: tuple[str, int | None], host: str, port: int) -> bool:
    pattern, allowed_port = entry
    if allowed_port is not None and allowed_port != port:
        return False
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern
