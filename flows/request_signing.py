"""Stage requests signed with a key only orchestrators and workers hold (POSTTRAIN_REQUEST_KEY).

A flow run of the `post-train-stage` deployment carries code (a reward module's source, written and
imported on the worker) and `${VAR}` placeholders (filled from the worker's environment): whoever
can create flow runs on the Prefect API could make a worker run their code, or send its secrets
anywhere. With the key set, the orchestrator signs each request (HMAC-SHA256 over the request as
sent, its placeholders and its digest, as canonical JSON), and a worker with the key runs only
requests that carry a valid signature, checked before anything of them is used. A worker without
the key runs every request, as before: set it wherever others can reach the API (docs/SECURITY.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_VARIABLE = "POSTTRAIN_REQUEST_KEY"
MIN_KEY_CHARS = 32
DOMAIN = b"posttrain stage request v1\n"  # a signature of something else never passes for a stage request's


class RequestNotSigned(ValueError):
    """A stage request this worker refuses; str() is one line."""


def request_key(environ=os.environ) -> bytes | None:
    """The key from the environment; None when it is unset or empty."""
    key = environ.get(KEY_VARIABLE, "")
    if not key:
        return None
    if len(key) < MIN_KEY_CHARS:
        raise RequestNotSigned(f"{KEY_VARIABLE}: at least {MIN_KEY_CHARS} characters, this one has {len(key)} "
                               "(e.g. the output of `openssl rand -hex 32`)")
    return key.encode()


def canonical(request: dict, placeholders, request_digest) -> bytes:
    """What is signed: the three parameters as JSON with sorted keys and no spaces, after a JSON
    round trip (what the Prefect API hands the worker: tuples become lists, keys text)."""
    parameters = json.loads(json.dumps({"request": request, "placeholders": placeholders,
                                        "request_digest": request_digest}))
    return DOMAIN + json.dumps(parameters, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(key: bytes, request: dict, placeholders, request_digest) -> str:
    return hmac.new(key, canonical(request, placeholders, request_digest), hashlib.sha256).hexdigest()


def check_signature(request: dict, placeholders, request_digest, signature, environ=os.environ) -> None:
    """Raise RequestNotSigned unless this worker holds no key, or `signature` is the request's under
    its key. Nothing of the request is used before this."""
    key = request_key(environ)
    if key is None:
        return
    if not isinstance(signature, str) or not signature:
        raise RequestNotSigned(f"request_signature: missing; this worker holds {KEY_VARIABLE} and runs only stage "
                               "requests signed with it (set the same key where the pipeline runs)")
    expected = sign(key, request, placeholders, request_digest)
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
        raise RequestNotSigned(f"request_signature: does not match the request; it was changed after it was "
                               f"signed, or signed with another {KEY_VARIABLE} than this worker's")
