"""Where a user's dataset comes from, and reading it: a .jsonl/.json/.parquet/.csv file, a folder of
them, a `datasets` save_to_disk folder, an fsspec URL (s3://bucket/chats.jsonl), or a hub dataset
id (`datasets.load_dataset`, from the local cache when HF_HUB_OFFLINE is set).

A local or URL source is read once by the orchestrator and kept in the store under its content
hash (`snapshot`): the stage reads that copy, so a worker never needs the user's files, and the
hash is what the stage's cache key sees. Symlinks are never followed: a source folder is user
input like any other.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
SAVED_DATASET = ("dataset_info.json", "state.json")  # what datasets' save_to_disk writes for one split
SAVED_DICT = "dataset_dict.json"  # ... and for a DatasetDict (one folder per split)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SNAPSHOT_MARKER = "SOURCE.json"  # written last: a snapshot folder without it is incomplete


class SourceError(ValueError):
    """A source that cannot be read; str() is one line naming it."""


@dataclass(frozen=True)
class Source:
    """A resolved `source:`: `local` (an absolute path), `url` (fsspec) or `hub` (a dataset id)."""

    kind: str
    where: str
    written: str  # as the spec wrote it, for messages

    @property
    def name(self) -> str:
        return PurePosixPath(self.where.rstrip("/")).name


def locate(written: str, spec_dir: Path | None) -> Source:
    """Resolve a `source:` string: a URL, else a path (relative to the spec's folder) that exists or
    names a data file, else a hub id."""
    if "://" in written and not written.startswith("file://"):
        return Source("url", written, written)
    path = Path(written.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        path = (spec_dir or Path.cwd()) / path
    if os.path.lexists(path) or written.endswith(SUFFIXES) or written.startswith((".", "/", "~")) \
            or not HUB_ID.match(written):
        return Source("local", str(Path(os.path.abspath(path))), written)
    return Source("hub", written, written)


def options_for(source: Source, store_uri: str, storage_options: dict) -> dict:
    """A URL on the store's own filesystem (s3://...) is read with the spec's storage options."""
    same = source.kind == "url" and source.where.split("://")[0] == store_uri.split("://")[0]
    return dict(storage_options) if same else {}


def _fs(source: Source, options: dict):
    import fsspec

    return fsspec.core.url_to_fs(source.where, **options)


def source_files(source: Source, options: dict | None = None) -> dict[str, bytes]:
    """Every data file of a local or URL source, keyed by its path under the source (a file: its
    name). SourceError when it is missing, a symlink, or holds no data file."""
    if source.kind == "local":
        return _local_files(Path(source.where), source.written)
    fs, root = _fs(source, options or {})
    try:
        if not fs.isdir(root):
            return {source.name: fs.cat_file(root)}
        found = {PurePosixPath(path).relative_to(root.rstrip("/")).as_posix(): fs.cat_file(path)
                 for path in sorted(fs.find(root))}
    except (OSError, ValueError) as exc:
        raise SourceError(f"{source.written}: cannot read ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    if not found:
        raise SourceError(f"{source.written}: not found")
    return found


def _local_files(path: Path, written: str) -> dict[str, bytes]:
    if path.is_symlink():
        raise SourceError(f"{written}: is a symlink (sources are read without following links)")
    if path.is_file():
        return {path.name: path.read_bytes()}
    if not path.is_dir():
        raise SourceError(f"{written}: not found")
    files = {}
    for item in sorted(path.rglob("*")):
        if item.is_symlink():
            raise SourceError(f"{written}: {item.relative_to(path)} is a symlink "
                              "(sources are read without following links)")
        if item.is_file():
            files[item.relative_to(path).as_posix()] = item.read_bytes()
    if not files:
        raise SourceError(f"{written}: the folder holds no file")
    return files


def digest(files: dict[str, bytes]) -> str:
    """The content hash of a source: its files' names and bytes."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def hub_revision(dataset_id: str) -> str | None:
    """The commit of a hub dataset in the local cache, or None when it is not there."""
    from huggingface_hub.constants import HF_HUB_CACHE

    refs = Path(HF_HUB_CACHE) / f"datasets--{dataset_id.replace('/', '--')}" / "refs" / "main"
    return refs.read_text().strip() if refs.is_file() else None


def check_hub(source: Source) -> None:
    """Offline (HF_HUB_OFFLINE), a hub dataset must already be in the local cache."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") and hub_revision(source.where) is None:
        raise SourceError(f"{source.written}: hub dataset not in the local cache, and HF_HUB_OFFLINE is set "
                          "(no file or folder of that name either)")


# ---- reading: columns (what `validate` needs) and rows (what the stage imports)

def _data_names(files: dict[str, bytes]) -> list[str]:
    return [name for name in sorted(files) if name.endswith(SUFFIXES)]


def _is_saved(files: dict[str, bytes]) -> bool:
    return any(name.rsplit("/", 1)[-1] in SAVED_DATASET + (SAVED_DICT,) for name in files)


def columns_of(files: dict[str, bytes], split: str | None, written: str) -> list[str]:
    """The column names of a source's data, read from its first file (or its saved features)."""
    if _is_saved(files):
        info = _saved_split_prefix(files, split, written) + "dataset_info.json"
        if info not in files:
            raise SourceError(f"{written}: a saved dataset without {info}")
        return list(json.loads(files[info])["features"])
    names = _data_names(files)
    if not names:
        raise SourceError(f"{written}: no {', '.join(SUFFIXES)} file in it")
    name, data = names[0], files[names[0]]
    if name.endswith(".csv"):
        return next(csv.reader(io.StringIO(data.decode("utf-8", "replace"))), [])
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(pq.read_schema(io.BytesIO(data)).names)
    rows = _json_rows(data, name, written, first_only=True)
    return list(rows[0]) if rows else []


def _saved_split_prefix(files: dict[str, bytes], split: str | None, written: str) -> str:
    """The folder (as a path prefix) of the saved split to read: '' for a saved Dataset."""
    if SAVED_DICT not in files:
        return ""
    splits = json.loads(files[SAVED_DICT])["splits"]
    chosen = split or ("train" if "train" in splits else splits[0])
    if chosen not in splits:
        raise SourceError(f"{written}: no split {chosen!r} (splits: {', '.join(splits)})")
    return f"{chosen}/"


def _json_rows(data: bytes, name: str, written: str, first_only: bool = False) -> list[dict]:
    text = data.decode("utf-8")
    stripped = text.lstrip()
    try:
        if name.endswith(".json") and stripped.startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None  # JSON Lines under a .json name
            if isinstance(value, list):
                return value[:1] if first_only else value
            if isinstance(value, dict):  # columns: {name: [values]}
                keys = list(value)
                count = len(value[keys[0]]) if keys else 0
                return [{key: value[key][i] for key in keys} for i in range(min(count, 1) if first_only else count)]
        lines = [line for line in text.splitlines() if line.strip()]
        return [json.loads(line) for line in (lines[:1] if first_only else lines)]
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise SourceError(f"{written}: {name} is not JSON or JSON Lines ({exc})".splitlines()[0]) from None


def rows_of(files: dict[str, bytes], split: str | None, written: str) -> list[dict]:
    """Every row of a source's data, in order (files sorted by name)."""
    if _is_saved(files):
        return _saved_rows(files, split, written)
    rows: list[dict] = []
    for name in _data_names(files):
        data = files[name]
        if name.endswith(".csv"):
            rows += list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows += pq.read_table(io.BytesIO(data)).to_pylist()
        else:
            rows += _json_rows(data, name, written)
    return rows


def _saved_rows(files: dict[str, bytes], split: str | None, written: str) -> list[dict]:
    """A save_to_disk folder's rows: its Arrow files, read with pyarrow (no pickle, no code)."""
    import pyarrow as pa

    prefix = _saved_split_prefix(files, split, written)
    state = json.loads(files[prefix + "state.json"])
    rows: list[dict] = []
    for entry in state["_data_files"]:
        with pa.ipc.open_stream(io.BytesIO(files[prefix + entry["filename"]])) as reader:
            rows += reader.read_all().to_pylist()
    return rows


def hub_rows(source: Source, split: str | None) -> list[dict]:
    """A hub dataset's rows through datasets.load_dataset (its split; 'train' by default)."""
    from datasets import load_dataset

    return list(load_dataset(source.where, split=split or "train"))
