"""Which stores an evaluation started by an event may open (POSTTRAIN_ALLOWED_STORES).

Whoever can post an event to the Prefect API names the store and its options; the worker would
then read the spec kept there and fill it from its own environment. So a triggered evaluation
opens only a store the worker's environment allows: an entry is a store URI (the store itself
or any store under it), with `?key=value` for each storage option the event may carry (dotted
for nested ones): `s3://team/posttrain?endpoint_url=http://minio:9000`. An event's options must
be exactly the entry's: another endpoint, TLS verification turned off, another addressing style
all change which server is asked. An event that names another store is refused.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode

from artifacts.store import StoreLocation

VARIABLE = "POSTTRAIN_ALLOWED_STORES"


class StoreNotAllowed(Exception):
    """str() is one line naming the store and the variable."""


def allowed_entries(environ=os.environ) -> list[str]:
    return [entry for entry in environ.get(VARIABLE, "").replace(",", " ").split() if entry]


def entry_for(location: StoreLocation) -> str:
    """The entry that allows exactly this store (and those under it) on its server."""
    pinned = _flat(location.options)
    return _normalised(location.uri) + ("?" + urlencode(pinned) if pinned else "")


def check_allowed(location: StoreLocation, entries: list[str]) -> None:
    """Raise StoreNotAllowed unless an entry covers `location` (its normalised URI and its location options)."""
    if not entries:
        raise StoreNotAllowed(f"store: {location.uri} is not allowed here: {VARIABLE} is not set where this "
                              "evaluation runs (a space- or comma-separated list of store URIs)")
    wanted = _flat(location.options)
    for entry in entries:
        uri, _, query = entry.partition("?")
        if _covers(_normalised(uri), location.uri) and dict(parse_qsl(query)) == wanted:
            return
    where = "".join(f" with {key}={value}" for key, value in wanted.items())
    raise StoreNotAllowed(f"store: {location.uri}{where} is not in {VARIABLE}")


def _normalised(uri: str) -> str:
    if "://" not in uri:
        uri = "file://" + os.path.abspath(uri)
    scheme, _, path = uri.partition("://")
    if scheme == "file":
        path = os.path.normpath(path)
    return f"{scheme}://{path.rstrip('/')}"


def _covers(entry: str, uri: str) -> bool:
    """`uri` is the entry's store or lies under it (whole path components; no `.` or `..` in it)."""
    if any(part in (".", "..") for part in uri.partition("://")[2].split("/")):
        return False
    uri = _normalised(uri)
    return uri == entry or uri.startswith(entry + "/")


def _flat(options: dict, prefix: str = "") -> dict[str, str]:
    """{dotted key: value as text} of every option, nested ones included."""
    flat = {}
    for key, value in options.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat
