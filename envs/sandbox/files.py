"""Files inside the bubblewrap sandbox, for its agent (stdlib only; see envs/sandbox/agent.py): the
host's writes, the workspace's snapshot for graders, and the grader's folder emptied before use."""

import base64
import contextlib
import os
import stat

GRADER = "/grader"  # envs/sandbox/launch.py mounts it
SNAPSHOT_FILE_BYTES, SNAPSHOT_TOTAL_BYTES, SNAPSHOT_ENTRIES = 65536, 4 << 20, 20000


def put(path, data):
    """Writes exactly `path`, following no link: whatever the policy left in the way (a link, a file
    where a folder goes, a folder without write permission) is replaced or opened up first."""
    target = os.path.normpath(path)
    root = next((root for root in ("/work", "/tmp", GRADER) if target.startswith(root + "/")), None)
    if root is None:
        return {"error": f"not writable: {path}"}
    folder = root
    for part in os.path.relpath(os.path.dirname(target), root).split("/"):
        folder = os.path.normpath(os.path.join(folder, part))
        if os.path.islink(folder) or (os.path.lexists(folder) and not os.path.isdir(folder)):
            os.unlink(folder)
        if not os.path.lexists(folder):
            os.mkdir(folder)
        os.chmod(folder, os.lstat(folder).st_mode | 0o700)
    if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
        os.unlink(target)
    handle = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(handle, "wb") as stream:
        stream.write(base64.b64decode(data))
    return {"error": None}


def empty(folder):
    """Removes everything under `folder`, whatever links or permissions the policy left there."""
    os.chmod(folder, 0o755)
    for root, dirs, _ in os.walk(folder):  # top-down: each folder is opened up before it is listed
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):  # os.walk lists links to folders too (it does not enter them)
                os.chmod(path, 0o700)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil  # here: with bz2, lzma and fnmatch it costs ~3 ms of every sandbox's start

            shutil.rmtree(path)
        else:
            os.unlink(path)


def snapshot():
    files, total, entries = {}, 0, 0
    for root, dirs, names in os.walk("/work"):  # os.walk does not follow links to directories
        for name in names:
            entries += 1
            path = os.path.join(root, name)
            info = os.lstat(path)
            wanted = stat.S_ISREG(info.st_mode) and info.st_size <= SNAPSHOT_FILE_BYTES
            if entries > SNAPSHOT_ENTRIES or (wanted and total + info.st_size > SNAPSHOT_TOTAL_BYTES):
                return {"files": files, "error": None}
            if wanted:
                with contextlib.suppress(OSError), open(path, "rb") as handle:  # chmod 000 by the policy
                    data = handle.read(SNAPSHOT_FILE_BYTES)
                    total += len(data)
                    files[os.path.relpath(path, "/work")] = base64.b64encode(data).decode()
    return {"files": files, "error": None}
