"""Reading a task folder (terminal's environment/ and tests/, openclaw's skills and workspace files,
`posttrain sandbox --files`) without following symlinks: task folders come from third-party
packages, and a link would be read as its target, on the host, with the orchestrator's rights."""

from __future__ import annotations

from pathlib import Path


def files_below(folder: Path) -> dict[str, Path]:
    """Regular files below `folder` by their POSIX path relative to it (none when it is absent);
    ValueError naming the first symlink found below it."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    if folder.is_symlink():
        raise ValueError(f"{folder}: a symlink (task folders are read without following links)")
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path}: a symlink (task folders are read without following links)")
        if path.is_file():
            found[path.relative_to(folder).as_posix()] = path
    return found


def regular_file(path: Path, root: Path) -> Path:
    """`path`, refused (ValueError naming the link) when it or a folder between it and `root` is a symlink."""
    current = Path(path)
    while current != Path(root) and Path(root) in current.parents:
        if current.is_symlink():
            raise ValueError(f"{current}: a symlink (task folders are read without following links)")
        current = current.parent
    return Path(path)
