"""A source's files kept in the store under their content hash: `sources/<digest>/`.

The orchestrator reads a local or URL source once and keeps it here (written before its
`SOURCE.json`, which lists every file with its sha256 and is written last); the stage reads the
copy back, checking each file's hash and that no listed name leaves the folder."""

from __future__ import annotations

import hashlib
from pathlib import PurePosixPath

from artifacts.store import Store, StoreError
from data_contracts.sources import SNAPSHOT_MARKER, SourceError, digest


def snapshot_path(store: Store, source_digest: str) -> str:
    return store.path("sources", source_digest)


def keep(store: Store, files: dict[str, bytes]) -> dict:
    """Keep `files` in the store unless a complete copy is there; returns the request's entry
    `{digest, files}` (the digest is what cache keys see)."""
    source_digest = digest(files)
    folder = snapshot_path(store, source_digest)
    if not store.exists(f"{folder}/{SNAPSHOT_MARKER}"):
        for name, data in files.items():
            store.write_bytes(f"{folder}/{name}", data)
        store.write_json(f"{folder}/{SNAPSHOT_MARKER}",
                         {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())})
    return {"digest": source_digest, "files": len(files)}


def _safe_name(name: str) -> bool:
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def kept_files(store: Store, source_digest: str) -> dict[str, bytes]:
    """The files of a kept source, each checked against the hash its listing gives."""
    folder = snapshot_path(store, source_digest)
    try:
        listing = store.read_json(f"{folder}/{SNAPSHOT_MARKER}")
    except StoreError:
        raise SourceError(f"source {source_digest[:12]} is not in the store ({folder})") from None
    files = {}
    for name, expected in listing.items():
        if not _safe_name(name):
            raise SourceError(f"{folder}/{SNAPSHOT_MARKER}: file name {name!r} leaves its folder")
        data = store.read_bytes(f"{folder}/{name}")
        if hashlib.sha256(data).hexdigest() != expected:
            raise SourceError(f"{folder}/{name}: content does not match its hash")
        files[name] = data
    if digest(files) != source_digest:
        raise SourceError(f"{folder}: the files do not hash to the folder's name")
    return files
