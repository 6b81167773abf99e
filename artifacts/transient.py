"""Which store errors are worth another try, and trying again within a budget.

An object store answers some requests with 5xx or throttling codes in bursts, times out, or drops a
connection; another try may pass. Any other answer (access denied, no such bucket or key, a failed
precondition) is final at once.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections.abc import Callable
from typing import TypeVar

from artifacts.text import first_line

# How long one store operation (a read, a write, one file of a commit) keeps trying again after
# transient errors: 5xx answers, throttling, timeouts, dropped connections. Each try is itself the
# client's (botocore's own few retries, s3fs's on SlowDown); a real endpoint's bursts of 503s can
# outlast those by far, while a stage's commit should rather wait a minute than fail.
RETRY_BUDGET_SECONDS = 120.0
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 15.0
# S3 error codes worth another try whatever their status (409: a conditional write raced another)
TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "RequestTimeout", "ServiceUnavailable", "InternalError", "ConditionalRequestConflict"}
Result = TypeVar("Result")


class GaveUp(Exception):
    """Transient errors for the whole budget; str(): the last one and how many tries it took."""


def retrying(call: Callable[..., Result], budget_seconds: float, *args, **kwargs) -> Result:
    """`call(*args, **kwargs)`, tried again after transient errors (`transient`), waiting `backoff`
    between tries, for up to `budget_seconds`; then GaveUp. Other errors pass through as they are."""
    started = time.monotonic()
    for tries in itertools.count(1):
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if not transient(exc):
                raise
            pause, spent = backoff(tries), time.monotonic() - started
            if spent + pause > budget_seconds:
                raise GaveUp(f"{transient_reason(exc)}, {tries} tries in {spent:.0f}s") from None
            time.sleep(pause)


def transient(error: BaseException) -> bool:
    """Whether a store call that raised `error` may pass when tried again: an answer with a 5xx or
    429 status or a throttling code, or no answer at all (a timeout; a dropped, reset or refused
    connection). Any other answer is final: access denied, no such bucket or key, a failed
    precondition (create-only found the object)."""
    for cause in _causes(error):
        answer = _s3_answer(cause)
        if answer is not None:
            status, code = answer
            return status >= 500 or status == 429 or code in TRANSIENT_CODES
        if isinstance(cause, _transport_errors()):
            return True
    return False


def transient_reason(error: BaseException) -> str:
    """The S3 answer (code and status) behind `error`, else its type and first line."""
    for cause in _causes(error):
        answer = _s3_answer(cause)
        if answer is not None:
            return f"{answer[1]} (HTTP {answer[0]})"
    return f"{type(error).__name__}: {first_line(error)}".rstrip(": ")


def backoff(tries: int) -> float:
    """Seconds to wait after the `tries`-th failed try: a ceiling doubling from FIRST_BACKOFF_SECONDS
    up to MAX_BACKOFF_SECONDS, the wait drawn from its upper half (so writers failed together spread)."""
    ceiling = min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2 ** (tries - 1))
    return random.uniform(ceiling / 2, ceiling)


def _causes(error: BaseException | None):
    """`error` and the errors it was raised from (s3fs turns botocore's into OSErrors)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _s3_answer(error: BaseException) -> tuple[int, str] | None:
    """(HTTP status, error code) of a botocore ClientError's answer; None for any other error."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict) or "ResponseMetadata" not in response:
        return None
    status = response["ResponseMetadata"].get("HTTPStatusCode")
    if not isinstance(status, int):
        return None
    return status, str((response.get("Error") or {}).get("Code") or status)


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """Errors of the connection rather than of an answer: Python's own, and those of the S3
    client's layers where they are installed (artifacts needs them only for s3://)."""
    errors: list[type[BaseException]] = [TimeoutError, ConnectionError]
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, IncompleteReadError
        from botocore.parsers import ResponseParserError  # a throttled answer's XML may be cut short

        errors += [BotoConnectionError, HTTPClientError, IncompleteReadError, ResponseParserError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError

        errors += [ClientConnectionError, ClientPayloadError]
    except ImportError:
        pass
    return tuple(errors)
