"""A vLLM worker extension: full-weight sync from an rl stage's sync folder to a vLLM server.

Put this file on the vLLM server's PYTHONPATH, name the sync folder in POSTTRAIN_SYNC_ROOT, and
start the server with its development routes on, on a private interface (vLLM's --api-key guards
only /v1; /pause, /collective_rpc and the rest stay open to whoever reaches the port):

    POSTTRAIN_SYNC_ROOT=/shared/posttrain-sync VLLM_SERVER_DEV_MODE=1 PYTHONPATH=deployments \
        vllm serve MODEL --host 127.0.0.1 --api-key "$KEY" \
        --worker-extension-cls posttrain_vllm_worker.PosttrainWorkerExtension ...

vLLM mixes this class into every worker; the rl stage (tasks/rollout/weight_sync.py) calls its
methods through /collective_rpc: `posttrain_weight_format` once (quantization, served dtype, sync
root), then for each version `posttrain_check_weights(FOLDER)` while the server still decodes, and
`posttrain_load_weights(FOLDER)` between /pause and /resume.

What a version may be, and how it is read:
- FOLDER is a directory directly inside POSTTRAIN_SYNC_ROOT (nothing else is loaded: without the
  variable, nothing at all), opened without following a link (O_NOFOLLOW | O_DIRECTORY, relative to
  the opened root), and each of its .safetensors files likewise (O_NOFOLLOW, relative to the opened
  directory; a link is refused, named). What is checked is what is read: the descriptors opened by
  the check are the ones the load reads, so nothing can be swapped in between.
- Every tensor of every file is read and checked before any reaches the model: the safetensors
  header (offsets inside the file, sizes that match dtype and shape), floating-point dtypes only,
  names of dotted identifiers, each name once; and from the second version on, the same names,
  shapes and dtypes as the last version loaded. A version that fails leaves the model as it was.
- The load goes through the model's own `load_weights` (HF names onto vLLM's fused, sharded
  parameters, copied in place). Should it fail part way (a device error), the model may hold mixed
  weights: the error says so, and the stage retries or reloads its last good version before
  /resume (it never resumes a server on mixed weights).
- Every tensor-parallel worker reads every file whole, as vLLM's own loader does (`load_weights`
  takes whole HF tensors and shards them itself); on one host the page cache serves the ranks after
  the first. Tensors stream one at a time, so a worker holds one tensor beyond the model.

Only the standard library and torch are imported: nothing of posttrain needs installing beside vLLM.
"""

from __future__ import annotations

import json
import os
import re
import stat

ROOT_VARIABLE = "POSTTRAIN_SYNC_ROOT"
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors dtype -> torch dtype
ITEM_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
MAX_HEADER = 100 * 2**20  # bytes of a safetensors JSON header
OPEN_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
OPEN_FOLDER = OPEN_FILE | os.O_DIRECTORY


class PosttrainWorkerExtension:
    """Methods vLLM adds to its workers (`self.model_runner.model` is the served model)."""

    def posttrain_weight_format(self) -> dict:
        """What the stage needs before it saves anything: the served model's quantization (full
        weights cannot go into kernel-format parameters), its dtype (versions are saved in it) and
        the root this worker loads from."""
        config = served_model_config(self)
        return {"quantization": none_or_str(getattr(config, "quantization", None)),
                "dtype": str(getattr(config, "dtype", "")).removeprefix("torch."),
                "sync_root": os.environ.get(ROOT_VARIABLE)}

    def posttrain_check_weights(self, folder: str) -> int:
        """Read and check every tensor of `folder` (the model untouched); the tensor count."""
        checked = self._posttrain_checked_version(folder, fresh=True)
        return len(checked.tensors)

    def posttrain_load_weights(self, folder: str) -> int:
        """Load the checked version in `folder` (checked now if it was not) into the served model;
        the tensor count."""
        checked = self._posttrain_checked_version(folder, fresh=False)
        done = [0]

        def weights():
            for name, tensor in checked.read_tensors():
                done[0] += 1
                yield name, tensor

        try:
            self.model_runner.model.load_weights(weights())
        except Exception as exc:
            raise RuntimeError(f"{folder}: loading stopped after {done[0]} of {len(checked.tensors)} tensors "
                               f"({type(exc).__name__}: {first_line(exc)}); the model may hold mixed weights") from exc
        self._posttrain_signature = checked.signature()
        self._posttrain_forget()
        return len(checked.tensors)

    def _posttrain_checked_version(self, folder: str, fresh: bool) -> "CheckedVersion":
        held = getattr(self, "_posttrain_held", None)
        if held is not None and held.folder == folder and not fresh:
            return held
        self._posttrain_forget()
        checked = CheckedVersion.open(folder)
        try:
            checked.read_all()
            checked.same_as(getattr(self, "_posttrain_signature", None))
        except BaseException:
            checked.close()
            raise
        self._posttrain_held = checked
        return checked

    def _posttrain_forget(self) -> None:
        held = getattr(self, "_posttrain_held", None)
        if held is not None:
            held.close()
        self._posttrain_held = None


class CheckedVersion:
    """A version's safetensors files, opened without following links, their headers parsed."""

    def __init__(self, folder: str, files: list[tuple[str, int, int]], tensors: dict[str, tuple]):
        self.folder = folder
        self.files = files  # (file name, descriptor, where its data starts)
        self.tensors = tensors  # name -> (file index, dtype, shape, begin, end)

    @classmethod
    def open(cls, folder: str) -> "CheckedVersion":
        root_fd = open_root()
        try:
            version_fd = open_version(root_fd, folder)
        finally:
            os.close(root_fd)
        files: list[tuple[str, int, int]] = []
        tensors: dict[str, tuple] = {}
        try:
            names = sorted(name for name in os.listdir(version_fd) if name.endswith(".safetensors"))
            if not names:
                raise ValueError(f"{folder}: no .safetensors file (weights are never loaded from a pickle)")
            for name in names:
                fd = open_file(version_fd, folder, name)
                files.append((name, fd, 0))
                start = read_header(fd, f"{folder}/{name}", len(files) - 1, tensors)
                files[-1] = (name, fd, start)
        except BaseException:
            for _, fd, _ in files:
                os.close(fd)
            raise
        finally:
            os.close(version_fd)
        return cls(folder, files, tensors)

    def read_all(self) -> None:
        """Read every tensor once (a short or failing read is an error now, not half a load)."""
        for _ in self.read_tensors():
            pass

    def read_tensors(self):
        """(name, tensor) of every tensor, file by file in header order, each read whole."""
        for name, (index, dtype, shape, begin, end) in self.tensors.items():
            file_name, fd, start = self.files[index]
            yield name, read_tensor(fd, f"{self.folder}/{file_name}", dtype, shape, start + begin, end - begin)

    def signature(self) -> dict[str, tuple]:
        return {name: (dtype, tuple(shape)) for name, (_, dtype, shape, _, _) in self.tensors.items()}

    def same_as(self, last: dict[str, tuple] | None) -> None:
        """The same tensors as the last version loaded (every version of a stage has them)."""
        if last is None:
            return
        mine = self.signature()
        for name in sorted(set(mine) | set(last)):
            if mine.get(name) != last.get(name):
                raise ValueError(f"{self.folder}: tensor {name} is {describe(mine.get(name))}, the last version "
                                 f"loaded had {describe(last.get(name))}; not a version of the same model")

    def close(self) -> None:
        for _, fd, _ in self.files:
            os.close(fd)
        self.files = []


def open_root() -> int:
    root = os.environ.get(ROOT_VARIABLE)
    if not root:
        raise ValueError(f"{ROOT_VARIABLE} is not set on the vLLM server: set it to the stage's sync_folder "
                         "(nothing is loaded from anywhere else)")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    if os.fstat(fd).st_mode & stat.S_IWOTH:
        os.close(fd)
        raise ValueError(f"{ROOT_VARIABLE} {root} is writable by others: anyone on the host could plant weights")
    return fd


def open_version(root_fd: int, folder: str) -> int:
    """The descriptor of `folder`, a directory directly inside the root, reached without a link."""
    root = os.environ[ROOT_VARIABLE]
    normal = os.path.normpath(folder)
    parent, name = os.path.split(normal)
    if not os.path.isabs(folder) or ".." in folder.split("/") or parent not in root_spellings(root) or \
            name in ("", ".", ".."):
        raise ValueError(f"{folder}: not a folder directly inside {ROOT_VARIABLE} ({root}); nothing else is loaded")
    try:
        return os.open(name, OPEN_FOLDER, dir_fd=root_fd)
    except OSError as exc:
        raise ValueError(f"{folder}: not a folder, or a link (links are not followed): {exc.strerror}") from None


def root_spellings(root: str) -> set[str]:
    return {os.path.normpath(root), os.path.realpath(root)}


def open_file(version_fd: int, folder: str, name: str) -> int:
    try:
        fd = os.open(name, OPEN_FILE, dir_fd=version_fd)
    except OSError as exc:
        raise ValueError(f"{folder}/{name}: cannot be opened without following a link ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{folder}/{name}: not a regular file")
    return fd


def read_header(fd: int, where: str, index: int, tensors: dict[str, tuple]) -> int:
    """Add the file's tensors to `tensors` (every field checked); where its data starts."""
    size = os.fstat(fd).st_size
    length = int.from_bytes(read_exactly(fd, 8, 0, where), "little")
    if not 2 <= length <= min(MAX_HEADER, size - 8):
        raise ValueError(f"{where}: not a safetensors file (header length {length})")
    try:
        header = json.loads(read_exactly(fd, length, 8, where))
    except ValueError:
        raise ValueError(f"{where}: not a safetensors file (its header is no JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: not a safetensors file (its header is no object)")
    data_size = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = checked_entry(where, name, entry, data_size, index, tensors)
    return 8 + length


def checked_entry(where: str, name: str, entry, data_size: int, index: int, tensors: dict) -> tuple:
    if not NAME.match(name) or name in tensors:
        problem = "repeated" if name in tensors else "not a dotted name"
        raise ValueError(f"{where}: tensor name {name[:80]!r} is {problem}")
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        kind = entry.get("dtype") if isinstance(entry, dict) else entry
        raise ValueError(f"{where}: tensor {name} is {str(kind)[:40]}, not a floating-point weight "
                         f"({', '.join(DTYPES)}); quantized checkpoints are not loaded")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and len(shape) <= 8):
        raise ValueError(f"{where}: tensor {name} has no valid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise ValueError(f"{where}: tensor {name} has no valid data offsets")
    begin, end = offsets
    count = 1
    for n in shape:
        count *= n
    if not 0 <= begin <= end <= data_size or end - begin != count * ITEM_SIZES[entry["dtype"]]:
        raise ValueError(f"{where}: tensor {name}'s data does not fit the file (a truncated or altered file)")
    return index, entry["dtype"], shape, begin, end


def read_tensor(fd: int, where: str, dtype: str, shape: list[int], offset: int, length: int):
    import torch

    tensor = torch.empty(shape, dtype=getattr(torch, DTYPES[dtype]))
    if length:
        read_into(fd, tensor.view(-1).view(torch.uint8).numpy(), offset, where)
    return tensor


def read_into(fd: int, buffer, offset: int, where: str) -> None:
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{where}: ends before its data does (a truncated file)")
        done += got


def read_exactly(fd: int, count: int, offset: int, where: str) -> bytes:
    data = os.pread(fd, count, offset)
    if len(data) != count:
        raise ValueError(f"{where}: ends before its header does (a truncated file)")
    return data


def served_model_config(worker):
    runner = getattr(worker, "model_runner", None)
    config = getattr(runner, "model_config", None)
    return config if config is not None else getattr(getattr(worker, "vllm_config", None), "model_config", None)


def describe(entry) -> str:
    return "absent" if entry is None else f"{entry[0]} {list(entry[1])}"


def none_or_str(value) -> str | None:
    return None if value is None else str(value)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
