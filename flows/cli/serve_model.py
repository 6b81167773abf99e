"""`posttrain serve-model REF`: a committed checkpoint behind an OpenAI-compatible API.

The checkpoint is fetched from the store (read in place from a local store) and served by
models/serving/ under the ref's name unless told otherwise, so that a client, a teacher spec
(`teacher: {endpoint, model: REF}`) or an EndpointPolicy names exactly the artifact it talks to.
It loads with the model config of the spec it was made from (dtype, LoRA base, device), as the
pipeline's own evaluation loads it; `--device` overrides the spec's `model.device`.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import get_args

from artifacts.refs import Ref
from artifacts.store import Store, StoreError, first_line
from flows.cli.common import open_store, resolve_ref
from flows.spec import SpecError, checkpoint_spec
from models.config import ModelConfig
from models.serving.limits import Limits

DEVICES = get_args(ModelConfig.model_fields["device"].annotation)  # auto, cpu


class ServeModelInputError(Exception):
    """Bad input to serve-model (ref, store, port); str() is the one-line message."""


def serve_model(ref: str, store_uri: str, host: str, port: int, name: str | None,
                limits: Limits | None = None, device: str | None = None, *, lora_folder: str | None = None,
                api_key: str | None = None, insecure_no_auth: bool = False, tool_call_parser: str | None = None) -> int:
    """Fetch the checkpoint and serve it until interrupted, refusing what `limits` bounds, on
    `device` (auto | cpu; None: the spec's `model.device`), with runtime LoRA adapters from
    `lora_folder` and every /v1 route behind `api_key` when given (required off loopback unless
    `insecure_no_auth`); exit code."""
    from models.serving import model_config
    from envs.tools.parsers import parser_for
    from models.serving.app import ListenError, serve

    check_authenticated(host, api_key, insecure_no_auth)
    check_limits(limits or Limits())
    check_device(device)
    if lora_folder is not None and not Path(lora_folder).is_dir():
        raise ServeModelInputError(f"--lora-folder: {lora_folder} is not a folder")
    store = open_store(store_uri, error=ServeModelInputError)
    pinned = resolve_ref(store, ref, error=ServeModelInputError)
    folder, model = fetch_checkpoint(pinned, store)
    if device is not None:
        model = (model or model_config(folder)).model_copy(update={"device": device})
    try:
        serve(folder, name or str(pinned), host=host, port=port, model=model, limits=limits, lora_folder=lora_folder,
              api_key=api_key, tool_parser=parser_for(tool_call_parser) if tool_call_parser else None)
    except ListenError as exc:
        raise ServeModelInputError(f"port: {exc}") from None
    except ValueError as exc:  # a served model that cannot take runtime adapters
        raise ServeModelInputError(first_line(exc)) from None
    return 0


def fetch_checkpoint(ref: Ref, store: Store, local_dir: Path | None = None) -> tuple[Path, ModelConfig | None]:
    """The local folder of a committed checkpoint (`local_dir`: a copy there) and its spec's model
    config (None when its producer records no spec); ServeModelInputError naming the field otherwise."""
    try:
        manifest = store.manifest(ref)
        if manifest["kind"] != "checkpoint":
            raise ServeModelInputError(f"ref: {ref} is a {manifest['kind']}, not a checkpoint")
        spec = checkpoint_spec(store, manifest)
        return store.fetch(ref, local_dir), spec.model if spec else None
    except StoreError as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    except SpecError as exc:
        raise ServeModelInputError(f"ref: {exc}") from None
    except OSError as exc:  # a remote store that fails mid-copy
        raise ServeModelInputError(f"store: cannot read {ref} from {store.uri} ({type(exc).__name__}: "
                                   f"{first_line(exc)})") from None


def check_authenticated(host: str, api_key: str | None, insecure_no_auth: bool) -> None:
    """Off loopback a server without a key answers, and loads weights for, whoever reaches the port:
    refused unless the operator says an authenticating proxy stands in front (`--insecure-no-auth`)."""
    if api_key or insecure_no_auth or is_loopback(host):
        return
    raise ServeModelInputError(f"--host: {host} is reachable from other machines and no key is set; give one with "
                               "--api-key-env VAR, or pass --insecure-no-auth if an authenticating proxy stands in "
                               "front")


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: localhost, 127.0.0.0/8 or ::1."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve anywhere
        return False


def check_device(device: str | None) -> None:
    if device not in (None, *DEVICES):
        raise ServeModelInputError(f"--device: {' or '.join(DEVICES)}, not {device!r}")


def check_limits(limits: Limits) -> None:
    """Each limit is positive (a flag of zero would refuse every request)."""
    for flag, value in (("--max-body-bytes", limits.max_body_bytes), ("--read-timeout", limits.read_timeout),
                        ("--queue-timeout", limits.queue_timeout), ("--max-connections", limits.max_connections),
                        ("--request-timeout", limits.request_timeout)):
        if not value > 0:
            raise ServeModelInputError(f"{flag}: must be positive, not {value}")
    if not 0 <= limits.batch_window <= 10:
        raise ServeModelInputError(f"--batch-window: seconds between 0 and 10, not {limits.batch_window}")
