"""Artifact references (`name@version`) and content hashing."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")
_VERSION = re.compile(r"^[0-9a-f]{16}$")


class BadRef(ValueError):
    """A string that is not `name@version`."""


@dataclass(frozen=True)
class Ref:
    name: str
    version: str

    @classmethod
    def parse(cls, text: str) -> "Ref":
        name, sep, version = text.rpartition("@")
        if not sep or not _NAME.fullmatch(name) or not _VERSION.fullmatch(version):
            raise BadRef(f"not an artifact ref (expected name@version, 16 hex digits): {text!r}")
        return cls(name, version)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


def valid_name(name: str) -> bool:
    return bool(_NAME.fullmatch(name))


RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"  # one path component: never `..`, never a slash


def valid_run_id(run_id: str) -> bool:
    return bool(re.fullmatch(RUN_ID, run_id))


def inside(relative: str) -> bool:
    """Whether a path read from the store (a manifest entry, a listing) stays inside its folder:
    relative, POSIX, no `..`, no empty or `.` parts, no backslash or NUL."""
    parts = relative.split("/")
    return bool(relative) and not relative.startswith("/") and "\\" not in relative and "\0" not in relative \
        and all(part not in ("", ".", "..") for part in parts)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def content_version(files: dict[str, str]) -> str:
    """Version of an artifact = hash over its (relative path, sha256) pairs."""
    return hashlib.sha256(canonical_json(sorted(files.items()))).hexdigest()[:16]


def hash_value(value) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()
