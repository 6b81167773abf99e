"""`posttrain serve-model REF`: a committed checkpoint behind an OpenAI-compatible API.

The checkpoint is fetched from the store (read in place from a local store) and served by
models/serving.py under the ref's name unless told otherwise, so that a client, a teacher spec
(`teacher: {endpoint, model: REF}`) or an EndpointPolicy names exactly the artifact it talks to.
It loads with the model config of the spec it was made from (dtype, LoRA base), as the
pipeline's own evaluation loads it.
"""

from __future__ import annotations

from pathlib import Path

from artifacts.refs import Ref
from artifacts.store import Store, StoreError, first_line
from flows.cli.common import open_store, resolve_ref
from flows.spec import SpecError, checkpoint_spec
from models.config import ModelConfig
from models.serving_limits import Limits


class ServeModelInputError(Exception):
    """Bad input to serve-model (ref, store, port); str() is the one-line message."""


def serve_model(ref: str, store_uri: str, host: str, port: int, name: str | None,
                limits: Limits | None = None) -> int:
    """Fetch the checkpoint and serve it until interrupted, refusing what `limits` bounds; exit code."""
    from models.serving import ListenError, serve

    check_limits(limits or Limits())
    store = open_store(store_uri, error=ServeModelInputError)
    pinned = resolve_ref(store, ref, error=ServeModelInputError)
    folder, model = fetch_checkpoint(pinned, store)
    try:
        serve(folder, name or str(pinned), host=host, port=port, model=model, limits=limits)
    except ListenError as exc:
        raise ServeModelInputError(f"port: {exc}") from None
    return 0


def fetch_checkpoint(ref: Ref, store: Store) -> tuple[Path, ModelConfig | None]:
    """The local folder of a committed checkpoint and its spec's model config (None when its
    producer records no spec); ServeModelInputError naming the field otherwise."""
    try:
        manifest = store.manifest(ref)
        if manifest["kind"] != "checkpoint":
            raise ServeModelInputError(f"ref: {ref} is a {manifest['kind']}, not a checkpoint")
        spec = checkpoint_spec(store, manifest)
        return store.fetch(ref), spec.model if spec else None
    except StoreError as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    except SpecError as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    except OSError as exc:  # a remote store that fails mid-copy
        raise ServeModelInputError(f"store: cannot read {ref} from {store.uri} ({type(exc).__name__}: "
                                   f"{first_line(exc)})") from None


def check_limits(limits: Limits) -> None:
    """Each limit is positive (a flag of zero would refuse every request)."""
    for flag, value in (("--max-body-bytes", limits.max_body_bytes), ("--read-timeout", limits.read_timeout),
                        ("--queue-timeout", limits.queue_timeout), ("--max-connections", limits.max_connections)):
        if not value > 0:
            raise ServeModelInputError(f"{flag}: must be positive, not {value}")
