"""The sync folder an rl stage publishes its weights through (`rollout.sync_folder`): the inference
server loads what it finds there, so whoever can write into it chooses the weights the server serves.

- The folder is made private (0700), or 0750 with `rollout.sync_folder_mode: group`, for a server
  that runs as another user of the folder's group. An existing folder is refused, in one line naming
  it, when another user owns it or its group or others may write into it (a planted version, or a
  link where a version will be written), or when it is a link another user owns.
- Each version is written into a fresh directory made by `mkdtemp` (a name never used before,
  created here with O_EXCL semantics, so nothing planted can stand in its way), named
  `<stage>-<nonce>-v<N>-<random>`. The nonce is the run's own: two runs sharing the folder never
  write, load or delete each other's versions. The server is sent that path as it is, never a
  resolved one.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

MODES = {"private": 0o700, "group": 0o750}  # the folder and each version's directory
FILE_MODES = {"private": 0o600, "group": 0o640}  # each file of a version
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class SyncFolderError(ValueError):
    """A sync folder that others could write into; one line naming it."""


def run_nonce() -> str:
    """A run's own mark in its version and adapter names (8 hex digits)."""
    return secrets.token_hex(4)


def prepared_folder(folder: str | Path, mode: str = "private") -> Path:
    """`folder`, created with MODES[mode] when missing, checked otherwise."""
    path = Path(folder)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=MODES[mode])
            os.chmod(path, MODES[mode])  # the umask may have taken bits mode asked for
        except FileExistsError:
            pass  # made meanwhile by someone else: checked below like any existing folder
    check_folder(path)
    return path


def check_folder(path: Path) -> None:
    """Refuse a folder (or a link to one) that another user owns or others may write into."""
    me = os.geteuid()
    link = path.lstat() if path.is_symlink() else None
    if link is not None and link.st_uid not in (me, 0):
        raise SyncFolderError(f"sync_folder {path}: a link owned by uid {link.st_uid}, not by this user "
                              f"(uid {me}); give a folder of your own")
    try:
        info = path.stat()
    except OSError as exc:
        raise SyncFolderError(f"sync_folder {path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SyncFolderError(f"sync_folder {path}: not a folder")
    if info.st_uid != me:
        raise SyncFolderError(f"sync_folder {path}: owned by uid {info.st_uid}, not by this user (uid {me}); "
                              "the server loads what is there, so use a folder of your own")
    if info.st_mode & WRITABLE_BY_OTHERS:
        raise SyncFolderError(f"sync_folder {path}: writable by its group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):o}); the server loads what is there: chmod 700 "
                              "(or 750 with sync_folder_mode: group)")


def version_folder(folder: Path, stage_id: str, nonce: str, version: int, mode: str = "private") -> Path:
    """A new, empty directory for one version (never a name used before, by this run or another)."""
    made = Path(tempfile.mkdtemp(prefix=f"{safe(stage_id)}-{nonce}-v{version}-", dir=folder))
    os.chmod(made, MODES[mode])
    return made


def share_files(saved: Path, mode: str) -> None:
    """The saved files readable by the folder's group too (group mode), else by this user alone."""
    for file in saved.iterdir():
        if file.is_file() and not file.is_symlink():
            os.chmod(file, FILE_MODES[mode])


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
