"""`posttrain serve-model REF`: a committed checkpoint behind an OpenAI-compatible API.

The checkpoint is fetched from the store (read in place from a local store) and served by
models/serving.py under the ref's name unless told otherwise, so that a client, a teacher spec
(`teacher: {endpoint, model: REF}`) or an EndpointPolicy names exactly the artifact it talks to.
"""

from __future__ import annotations

from pathlib import Path

from artifacts.refs import BadRef, Ref
from artifacts.store import Store, StoreError


class ServeModelInputError(Exception):
    """Bad input to serve-model (ref, store); str() is the one-line message."""


def serve_model(ref: str, store_uri: str, host: str, port: int, name: str | None) -> int:
    """Fetch the checkpoint and serve it until interrupted; exit code."""
    from models.serving import ListenError, serve

    folder = fetch_checkpoint(ref, store_uri)
    try:
        serve(folder, name or ref, host=host, port=port)
    except ListenError as exc:
        raise ServeModelInputError(f"port: {exc}") from None
    return 0


def fetch_checkpoint(ref: str, store_uri: str) -> Path:
    """The local folder of a committed checkpoint; ServeModelInputError naming the field otherwise."""
    try:
        parsed = Ref.parse(ref)
    except BadRef as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    store = open_store(store_uri)
    try:
        kind = store.manifest(parsed).get("kind")
        if kind != "checkpoint":
            raise ServeModelInputError(f"ref: {parsed} is a {kind}, not a checkpoint")
        return store.fetch(parsed)
    except StoreError as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    except OSError as exc:  # a remote store that fails mid-copy
        raise ServeModelInputError(f"store: cannot read {parsed} from {store.uri} ({type(exc).__name__}: "
                                   f"{first_line(exc)})") from None


def open_store(store_uri: str) -> Store:
    try:
        store = Store(store_uri)
        store.check_reachable()
    except StoreError as exc:
        raise ServeModelInputError(f"store: {exc}") from None
    except Exception as exc:  # a URI fsspec cannot open (unknown protocol, missing driver)
        raise ServeModelInputError(f"store: cannot open {store_uri} ({type(exc).__name__}: {first_line(exc)})") \
            from None
    return store


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
