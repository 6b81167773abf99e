"""What every `posttrain` command shares: the bad-input error, and opening a store, a spec, a ref
and the Prefect API with one-line errors."""

from __future__ import annotations

import sys

DEFAULT_STORE = "file://.posttrain/store"
QUIET_DEFAULTS = {
    "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GX_ANALYTICS_ENABLED": "False",
    "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
    # Prefect gives its temporary server 20 s to start, too little on a busy 2-core machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def open_store(uri: str, storage_options: dict | None = None, error: type[Exception] = UserError):
    """The store at `uri`, reachable and writable; `error` (one line naming `store`) otherwise."""
    from artifacts.store import Store, StoreError

    try:
        store = Store(uri, storage_options)
        store.check_reachable()
    except StoreError as exc:
        raise error(f"store: {exc}") from None
    return store


def open_named_store(uri: str | None, spec_path: str | None):
    """The store a command reads: `--store`, else the `store:` of the spec `--spec` names (with its
    `storage_options` either way), else the default."""
    if spec_path is None:
        return open_store(uri or DEFAULT_STORE)
    location = open_spec(spec_path)[0].store_location(uri)
    return open_store(location.uri, location.options)


def check_prefect_api() -> str | None:
    """The Prefect API of PREFECT_API_URL if one is named (None: ephemeral mode); a named server
    that does not answer is bad input, before anything runs."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if api is None:
        return None
    import httpx

    try:
        httpx.get(f"{api.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"PREFECT_API_URL {api}: the Prefect server does not answer ({reason})") from None
    return api


def temporary_api(api: str | None):
    """In ephemeral mode (`api` None: no PREFECT_API_URL), Prefect's temporary API server started
    now (flows/temporary_api.py), watched by the reaper (flows/cli/reaper.py); else None."""
    if api is not None:
        return None
    from flows.cli.reaper import start as start_reaper
    from flows.temporary_api import TemporaryApi

    start_reaper()  # first: the server inherits the token the reaper looks for
    return TemporaryApi()


def use_temporary_api(server) -> None:
    """Wait for `server` (temporary_api's) to answer and make it this process's Prefect API."""
    if server is not None:
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        server.use(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())


def open_spec(path: str):
    from flows.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as exc:
        raise UserError(str(exc)) from None


def resolve_ref(store, text: str, error: type[Exception] = UserError):
    """A ref given on the command line: `name@version`, or `name@latest`, pinned (and printed) here;
    `error` (one line naming `ref`) when it is neither or names nothing committed."""
    from artifacts.refs import BadRef
    from artifacts.store import StoreError

    try:
        ref = store.resolve(text)
    except (BadRef, StoreError) as exc:
        raise error(f"ref: {exc}") from None
    if str(ref) != text:
        print(f"{text} = {ref}", file=sys.stderr, flush=True)
    return ref


class OneLineTransportErrors:
    """A logging filter: a record that carries an error reaching a server (the Prefect API gone) keeps
    its message and loses its traceback; the run's own report says what happened."""

    def filter(self, record) -> bool:
        import httpx

        if record.exc_info and isinstance(record.exc_info[1], (httpx.TransportError, OSError)):
            record.msg, record.args = f"{record.getMessage()} ({type(record.exc_info[1]).__name__})", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_lost_api() -> None:
    """Prefect's console log shows a lost API in one line, not a traceback."""
    import logging

    for handler in logging.getLogger().handlers:
        handler.addFilter(OneLineTransportErrors())
