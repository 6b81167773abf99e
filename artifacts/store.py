"""The versioned object store: immutable artifact versions over fsspec (file:// or s3://).

Layout under the store root:
  artifacts/<name>/<version>/...      files of one version
  artifacts/<name>/<version>/MANIFEST.json   written last, create-only: exists = committed
  refs/<name>/latest                  alias for people; stages never read it
  cache/<key>.json                    stage cache index: stage key -> output refs
  scratch/<key>/step-<n>/             in-stage checkpoints of a running stage
  runs/<run id>.json                  run summaries
  specs/<hash>.yaml                   the spec texts runs were made from
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import posixpath
import tempfile
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import fsspec
from pydantic import BaseModel, ConfigDict

from artifacts.refs import BadRef, Ref, content_version, inside, sha256_bytes, valid_name
from artifacts.text import first_line  # noqa: F401 (the project imports it from here)
from artifacts.transient import RETRY_BUDGET_SECONDS, GaveUp, Result, retrying
from artifacts.urls import CREDENTIALS, ScrubbedError, credential_url_fields, holds_credentials

MANIFEST = "MANIFEST.json"
LATEST = "latest"  # `name@latest`: the alias people use; stages never read it
ARTIFACT_KINDS = ("dataset", "checkpoint", "reward_model", "report")
# storage options that may travel in specs, events and Prefect parameters: known non-secret ones
# only (deny by default); a value True allows any plain value, a dict lists the allowed sub-keys
NON_SECRET_OPTIONS = {
    "endpoint_url": True, "region_name": True, "anon": True, "use_ssl": True, "requester_pays": True,
    "version_aware": True, "default_block_size": True, "default_fill_cache": True, "default_cache_type": True,
    "cache_regions": True, "max_concurrency": True, "fixed_upload_size": True, "listings_expiry_time": True,
    "use_listings_cache": True, "skip_instance_cache": True, "account_name": True, "project": True,
    "client_kwargs": {"endpoint_url": True, "region_name": True, "verify": True, "use_ssl": True},
    "config_kwargs": {"signature_version": True, "connect_timeout": True, "read_timeout": True,
                      "max_pool_connections": True, "s3": {"addressing_style": True},
                      "retries": {"max_attempts": True, "mode": True}},
}
# where a store's credentials come from instead of its URI or options
FROM_THE_ENVIRONMENT = "give credentials through the environment or the cloud's credential chain"


class StoreError(ScrubbedError):
    """The store cannot be used (unreachable, missing object, bad options); a URL in its message
    shows no credentials."""


class AlreadyExists(StoreError):
    pass


def credential_keys(storage_options: dict, allowed: dict = NON_SECRET_OPTIONS) -> list[str]:
    """Dotted names of the options not on the non-secret allow-list (keys, tokens, SAS tokens,
    connection strings, headers: they belong in the environment or the cloud's credential chain)."""
    found = []
    for key, value in storage_options.items():
        rule = allowed.get(key)
        if rule is None or (isinstance(value, dict) and not isinstance(rule, dict)):
            found.append(key)
        elif isinstance(rule, dict):
            found += [f"{key}.{k}" for k in credential_keys(value, rule)] if isinstance(value, dict) else [key]
    return found


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class StoreLocation(BaseModel):
    """Where a store is: its URI and fsspec options (never credentials). It travels whole, from the
    spec to the flow, the stage request, the child process and the evaluation flow."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str
    options: dict = {}

    def open(self) -> "Store":
        return Store(self.uri, self.options)


class Store:
    retry_budget_s = RETRY_BUDGET_SECONDS  # per operation; tests shorten it on an instance

    def __init__(self, uri: str, storage_options: dict | None = None):
        self.storage_options = dict(storage_options or {})
        if credential_keys(self.storage_options):
            raise StoreError(f"storage_options must not hold credentials: {credential_keys(self.storage_options)}")
        if "@" in uri.split("://", 1)[-1].split("/", 1)[0] or holds_credentials(uri):
            raise StoreError(f"store: {CREDENTIALS}; {FROM_THE_ENVIRONMENT}")
        if credential_url_fields(self.storage_options):
            raise StoreError(f"storage_options.{credential_url_fields(self.storage_options)[0]}: {CREDENTIALS}; "
                             f"{FROM_THE_ENVIRONMENT}")
        if "://" not in uri:
            uri = "file://" + os.path.abspath(uri)
        self.uri = uri.rstrip("/")
        self.protocol = self.uri.split("://", 1)[0]
        try:
            self.fs, root = fsspec.core.url_to_fs(self.uri, **_driver_options(self.protocol, self.storage_options))
        except Exception as exc:  # an unknown protocol, a missing driver, options the driver refuses
            raise StoreError(f"cannot open {self.uri}: {first_line(exc)}") from None
        self.root = root.rstrip("/")
        self.local = self.protocol == "file"
        if self.local:  # fsspec made a relative path absolute against this process's cwd: keep that one
            self.uri = f"file://{self.root}"

    @property
    def location(self) -> StoreLocation:
        return StoreLocation(uri=self.uri, options=self.storage_options)

    # -- paths -------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def version_path(self, ref: Ref, *parts: str) -> str:
        return self.path("artifacts", ref.name, ref.version, *parts)

    def check_reachable(self) -> None:
        """Touch the store root so a bad endpoint/bucket fails before anything runs."""
        try:
            if self.local:
                _check_local_writable(self.root)
            else:
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise StoreError(f"bucket {bucket!r} does not exist")
        except StoreError:
            raise
        except Exception as exc:  # network, permissions, endpoint
            raise StoreError(f"cannot reach {self.uri}: {type(exc).__name__}: {first_line(exc)}") from None

    # -- small objects -----------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        try:
            return self._retrying("read", path, self.fs.cat_file, path)
        except FileNotFoundError:
            raise StoreError(f"not found in store: {self.display(path)}") from None

    def read_json(self, path: str):
        return json.loads(self.read_bytes(path))

    def exists(self, path: str) -> bool:
        return self._retrying("look up", path, self.fs.exists, path)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Overwrite `path` (used only for mutable things: aliases, run summaries, scratch)."""
        if self.local:
            os.replace(_local_temp_copy(path, data), path)
        else:
            self._retrying("write", path, self.fs.pipe_file, path, data)

    def write_json(self, path: str, value) -> None:
        self.write_bytes(path, json.dumps(value, indent=2, sort_keys=True, default=str).encode())

    def create_only(self, path: str, data: bytes) -> None:
        """Write `path` only if it does not exist yet; AlreadyExists otherwise. On an object store a
        write whose answer was lost may have landed all the same, and the next try (the client's
        own or this store's) then finds the object: it is this call's when it holds exactly `data`,
        someone else's otherwise, and is never overwritten."""
        if self.local:
            tmp = _local_temp_copy(path, data)
            try:
                os.link(tmp, path)  # atomic and fails if the target exists
            except FileExistsError:
                raise AlreadyExists(path) from None
            finally:
                os.unlink(tmp)
            return
        if self.exists(path):  # before anything of ours was sent: someone else's
            raise AlreadyExists(path)
        try:
            self._retrying("create", path, self._write_exclusive, path, data)
        except FileExistsError:
            if not self._holds(path, data):
                raise AlreadyExists(path) from None

    def _write_exclusive(self, path: str, data: bytes) -> None:
        """One try at creating `path` on an object store; FileExistsError when it is there."""
        try:
            with self.fs.open(path, "xb") as handle:  # S3 conditional write (If-None-Match)
                handle.write(data)
        except ValueError:  # an fsspec backend without exclusive create
            if self.fs.exists(path):
                raise FileExistsError(path) from None
            self.fs.pipe_file(path, data)

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self._retrying("read", path, self.fs.cat_file, path) == data
        except FileNotFoundError:  # removed since (a released claim): it was not ours either
            return False

    def put_dir(self, local_dir: Path, remote_dir: str, sizes: bool = False) -> None:
        """Upload a folder's files. On a local disk each is written under a temporary name, flushed to
        disk and renamed into place, so a second writer of the same version never truncates a file
        a reader may already see; `sizes`: on an object store, each upload's size is checked."""
        for file in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            target = posixpath.join(remote_dir, file.relative_to(local_dir).as_posix())
            if self.local:
                os.replace(_local_temp_copy(target, file.read_bytes(), sync=True), target)
                continue
            self._retrying("upload", target, self.fs.put_file, str(file), target)
            if sizes:
                self._check_size(target, file.stat().st_size)

    def _check_size(self, target: str, size: int) -> None:
        stored = self._retrying("look up", target, self.fs.info, target)["size"]
        if stored != size:
            raise StoreError(f"{self.display(target)}: uploaded {stored} bytes of {size}")

    def get_dir(self, remote_dir: str, local_dir: Path) -> Path:
        local_dir = Path(local_dir)
        for path in self._retrying("list", remote_dir, self.fs.find, remote_dir):
            rel = posixpath.relpath(path, remote_dir)
            if not inside(rel):
                raise StoreError(f"{self.display(remote_dir)}: listed path {rel!r} leaves the folder")
            (local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            self._retrying("download", path, self.fs.get_file, path, str(local_dir / rel))
        return local_dir

    def remove(self, path: str) -> None:
        self._retrying("remove", path, self._remove, path)

    def _remove(self, path: str) -> None:
        if self.fs.exists(path):  # again on a retry: the try before may have removed some or all
            self.fs.rm(path, recursive=True)

    def listdir(self, path: str) -> list[str]:
        try:
            listed = self._retrying("list", path, self.fs.ls, path, detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(p.rstrip("/")) for p in listed]

    def _retrying(self, what: str, path: str, call: Callable[..., Result], *args, **kwargs) -> Result:
        """`call(*args, **kwargs)`, tried again after transient errors for up to `retry_budget_s`
        (artifacts/transient.py); then one StoreError naming `path`."""
        try:
            return retrying(call, self.retry_budget_s, *args, **kwargs)
        except GaveUp as exc:
            raise StoreError(f"cannot {what} {self.display(path)}: {exc}") from None

    # -- artifacts ---------------------------------------------------------
    def commit(self, name: str, kind: str, local_dir: Path, *, producer: dict, inputs: dict[str, str] | None = None,
               siblings: dict[str, str] | None = None, metrics: dict | None = None,
               hashes: dict[str, str] | None = None) -> Ref:
        """Upload a folder as a new immutable version; the manifest goes last, create-only.

        `inputs` are artifacts that existed before the producing stage ran; `siblings` are the
        other outputs of the same stage run. `hashes` (from `folder_hashes`) spares hashing the
        files again. Committing the same files under the same name again returns the existing ref.
        """
        if kind not in ARTIFACT_KINDS:
            raise ValueError(f"artifact kind must be one of {ARTIFACT_KINDS}: {kind!r}")
        local_dir = Path(local_dir)
        hashes = hashes or folder_hashes(local_dir)
        ref = Ref(name, content_version(hashes))
        manifest_path = self.version_path(ref, MANIFEST)
        if self.exists(manifest_path):
            self._point_latest(ref)  # a retried commit that died before its alias
            return ref
        self.put_dir(local_dir, self.version_path(ref), sizes=True)
        manifest = {
            "ref": str(ref), "name": name, "version": ref.version, "kind": kind,
            "files": [{"path": rel, "sha256": hashes[rel], "size": (local_dir / rel).stat().st_size}
                      for rel in sorted(hashes)],
            "producer": producer, "inputs": dict(inputs or {}), "siblings": dict(siblings or {}),
            "metrics": dict(metrics or {}), "created": now_iso(),
        }
        try:
            self.create_only(manifest_path, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
        except AlreadyExists:
            pass  # a concurrent writer committed the same content
        self._point_latest(ref)
        return ref

    def _point_latest(self, ref: Ref) -> None:
        self.write_bytes(self.path("refs", ref.name, "latest"), ref.version.encode())

    def manifest(self, ref: Ref | str) -> dict:
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        path = self.version_path(ref, MANIFEST)
        if not self.exists(path):
            raise StoreError(f"no committed artifact {ref} in {self.uri}")
        return self.read_json(path)

    def manifests(self, pipeline: str | None = None) -> dict[str, dict]:
        """{ref: manifest} of every committed version of a pipeline's artifacts (all pipelines when
        None), scanning `artifacts/<pipeline>/<name>/<version>/` (every name posttrain writes is
        `<pipeline>/<stage id>[.<output>]`)."""
        pipelines = [pipeline] if pipeline is not None else self.listdir(self.path("artifacts"))
        manifests = {}
        for owner in pipelines:
            for name in self.listdir(self.path("artifacts", owner)):
                for version in self.listdir(self.path("artifacts", owner, name)):
                    path = self.path("artifacts", owner, name, version, MANIFEST)
                    if self.exists(path):  # else not committed
                        manifest = self.read_json(path)
                        manifests[manifest["ref"]] = manifest
        return manifests

    def is_committed(self, ref: Ref | str) -> bool:
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        return self.exists(self.version_path(ref, MANIFEST))

    def fetch(self, ref: Ref | str, local_dir: Path | None = None, hashes: bool | None = None) -> Path:
        """A committed version's files (not its manifest) in a local folder: the store's own folder
        for a local store without `local_dir`, else a copy. Every file's size is checked against the
        manifest, and its sha256 too where the store is remote (`hashes`: say otherwise), so a
        truncated upload or a file changed under the manifest is a StoreError, not a broken load."""
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        manifest = self.manifest(ref)
        hashes = not self.local if hashes is None else hashes
        if hashes and content_version({e["path"]: e["sha256"] for e in manifest["files"]}) != ref.version:
            raise StoreError(f"{ref}: the manifest's files do not hash to version {ref.version}")
        in_place = self.local and local_dir is None
        local_dir = Path(self.version_path(ref)) if in_place else Path(local_dir or tempfile.mkdtemp(prefix="posttrain-"))
        for entry in manifest["files"]:
            if not inside(entry["path"]):
                raise StoreError(f"{ref}: manifest file path {entry['path']!r} leaves the artifact's folder")
            target = local_dir / entry["path"]
            if not in_place:
                target.parent.mkdir(parents=True, exist_ok=True)
                remote = self.version_path(ref, entry["path"])
                self._retrying("download", remote, self.fs.get_file, remote, str(target))
            _check_fetched(ref, entry, target, hashes)
        return local_dir

    def verify(self, ref: Ref | str) -> list[str]:
        """Re-hash every file of a version, check that the manifest's hashes give the ref's version,
        and report files the manifest does not list (an extra adapter_config.json changes what
        loads); returns the problems found (empty = intact)."""
        ref = Ref.parse(ref) if isinstance(ref, str) else ref
        manifest = self.manifest(ref)
        listed = {entry["path"]: entry["sha256"] for entry in manifest["files"]}
        problems = []
        if content_version(listed) != ref.version:
            problems.append(f"the manifest's files hash to version {content_version(listed)}, not {ref.version}")
        folder = self.version_path(ref)
        present = {posixpath.relpath(path, folder) for path in self._retrying("list", folder, self.fs.find, folder)}
        problems += [f"{extra}: not in the manifest" for extra in sorted(present - set(listed) - {MANIFEST})]
        for entry in manifest["files"]:
            if not inside(entry["path"]):
                problems.append(f"{entry['path']!r}: leaves the artifact's folder")
                continue
            path = self.version_path(ref, entry["path"])
            if not self.exists(path):
                problems.append(f"{entry['path']}: missing")
                continue
            actual = sha256_bytes(self.read_bytes(path))
            if actual != entry["sha256"]:
                problems.append(f"{entry['path']}: sha256 {actual[:12]}… != manifest {entry['sha256'][:12]}…")
        return problems

    def latest(self, name: str) -> Ref:
        """The version `refs/<name>/latest` points at; its text is checked, and the version must be
        committed (a pointer is a convenience for people and may be stale or tampered with)."""
        if not valid_name(name):
            raise BadRef(f"not an artifact name: {name!r}")
        path = self.path("refs", name, "latest")
        if not self.exists(path):
            raise StoreError(f"no alias {name}@{LATEST} in {self.uri}")
        text = self.read_bytes(path).decode(errors="replace").strip()
        try:
            ref = Ref.parse(f"{name}@{text}")
        except BadRef:
            raise StoreError(f"refs/{name}/latest does not hold a version (16 hex digits): {text[:40]!r}") from None
        if not self.is_committed(ref):
            raise StoreError(f"refs/{name}/latest points at {ref}, which is not committed in {self.uri}")
        return ref

    def resolve(self, text: str) -> Ref:
        """A ref from `name@version`, or `name@latest` pinned to the version its alias names."""
        name, sep, version = text.rpartition("@")
        if sep and version == LATEST:
            return self.latest(name)
        return Ref.parse(text)

    def display(self, path: str) -> str:
        return f"{self.protocol}://{path}" if not self.local else path


def folder_hashes(local_dir: Path) -> dict[str, str]:
    """{relative path: sha256} of the files an artifact version of `local_dir` would hold."""
    local_dir = Path(local_dir)
    files = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
    if MANIFEST in files:
        raise ValueError(f"{MANIFEST} is reserved")
    if not files:
        raise ValueError(f"nothing to commit in {local_dir}")
    return {rel: sha256_file(path) for rel, path in files.items()}


def _driver_options(protocol: str, storage_options: dict) -> dict:
    """What the fsspec driver is given: a copy (botocore rewrites the dicts it gets, turning
    retries.max_attempts into total_max_attempts, while the options travel on to other processes as
    the spec wrote them), and for an object store no listing cache: other processes write the store,
    and a cached listing would never show their objects (a claim another run won, a version
    committed since, a file a failed write stored before its answer was lost)."""
    options = copy.deepcopy(storage_options)
    return options if protocol == "file" else {**options, "use_listings_cache": False}


def _check_fetched(ref: Ref, entry: dict, path: Path, hashes: bool) -> None:
    if path.is_symlink():
        raise StoreError(f"{ref}: {entry['path']} is a symlink")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{ref}: {entry['path']} is missing") from None
    if "size" in entry and size != entry["size"]:
        raise StoreError(f"{ref}: {entry['path']} is {size} bytes, the manifest says {entry.get('size')}")
    if hashes and sha256_file(path) != entry["sha256"]:
        raise StoreError(f"{ref}: {entry['path']} does not match its sha256 in the manifest")


def _check_local_writable(root: str) -> None:
    """The folder (or the nearest existing folder above it) must be a writable directory."""
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise StoreError(f"{root} is not a writable folder")


def _local_temp_copy(path: str, data: bytes, sync: bool = False) -> str:
    """Write `data` next to `path` under a temporary name (to be renamed or linked into place);
    `sync`: flushed to disk first (an artifact's data files, before its manifest)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as handle:
        handle.write(data)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())
    return tmp
