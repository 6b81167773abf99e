"""The terminal env's tasks: Harbor task folders read and checked (one line naming the file that is
wrong), and the generated families' variants as tasks (their files carried in `Task.info`).
Folders come from third-party packages: read without following symlinks (envs/task_files.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from envs.base import Task
from envs.task_files import files_below
from envs.terminal.families import variant

REMINDER = "\nRun one shell command per turn as <bash>COMMAND</bash>; write <done/> when finished."
REQUIRED = ("instruction.md", "task.toml", "tests/test.sh", "solution/solve.sh")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)")
_TOML_POSITION = re.compile(r"(.*) \(at line (\d+), column \d+\)$", re.S)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a typo or a quoted number is an error


class Timeout(_Section):
    timeout_sec: float = Field(600.0, gt=0)  # capped by the env's sandbox.wall_seconds (the agent's: per command)


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(600.0, gt=0)  # Harbor's; nothing is built here
    cpus: int = Field(1, ge=1)  # not enforced: the sandbox limits CPU seconds, not cores
    memory_mb: int = Field(2048, ge=64)
    storage_mb: int = Field(10240, ge=1)
    allow_internet: bool = False

    @field_validator("allow_internet")
    @classmethod
    def _offline(cls, allowed: bool) -> bool:
        if allowed:
            raise ValueError("must be false: the sandbox has no network")
        return allowed


class TaskToml(_Section):
    version: str = "1.0"
    split: Literal["train", "eval"] = "train"
    metadata: dict[str, object] = {}
    agent: Timeout = Timeout()
    verifier: Timeout = Timeout()
    environment: EnvironmentSection = EnvironmentSection()


def shown(path: Path) -> str:
    """A path as errors name it: relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{shown(path)}: unreadable ({exc})") from None


def read_task_toml(path: Path) -> TaskToml:
    try:
        data = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as exc:
        position = _TOML_POSITION.match(str(exc))
        detail = f"line {position.group(2)}: {position.group(1)}" if position else str(exc)
        raise ValueError(f"{shown(path)}: invalid TOML ({detail})") from None
    try:
        return TaskToml.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})" for e in exc.errors())
        raise ValueError(f"{shown(path)}: {problems}") from None


def solution_commands(path: Path) -> list[str]:
    """The oracle's commands: the non-empty, non-comment lines of solve.sh, one action each."""
    commands = []
    for number, line in enumerate(_read(path).splitlines(), 1):
        command = line.strip()
        if not command or command.startswith("#"):
            continue
        if command.endswith("\\") or _HEREDOC.search(command):
            raise ValueError(f"{shown(path)}:{number}: a command spans lines; write one whole command per line")
        commands.append(command)
    if not commands:
        raise ValueError(f"{shown(path)}: no commands (one shell command per line)")
    return commands


def load_task(folder: Path) -> Task:
    files = files_below(folder)  # refuses a symlink anywhere in the task folder, naming it
    for name in REQUIRED:
        if name not in files:
            raise ValueError(f"{shown(folder / name)}: missing (a task folder holds {', '.join(REQUIRED)})")
    config = read_task_toml(folder / "task.toml")
    instruction = _read(folder / "instruction.md").strip()
    if not instruction:
        raise ValueError(f"{shown(folder / 'instruction.md')}: empty")
    solution_commands(folder / "solution" / "solve.sh")
    return Task(id=folder.name, prompt=instruction + REMINDER, answer="",
                info={"path": str(folder.resolve()), "split": config.split,
                      "agent_timeout_sec": config.agent.timeout_sec,
                      "verifier_timeout_sec": config.verifier.timeout_sec, "memory_mb": config.environment.memory_mb,
                      "storage_mb": config.environment.storage_mb})


def generated_task(family: str, split: str, index: int, seed: int) -> Task:
    """Variant `index` of a generated family (envs/terminal/families.py) as a task; its files
    travel in `info` instead of a folder."""
    made = variant(family, split, index, seed)
    return Task(id=f"{family}-{split[0]}{index}", prompt=made.instruction + REMINDER, answer="",
                info={"split": split, "family": family, "agent_timeout_sec": 5.0, "verifier_timeout_sec": 5.0,
                      "memory_mb": 256, "storage_mb": 16, "setup": made.files, "tests": {"test.sh": made.test},
                      "solution": list(made.solution)})


def task_files(task: Task, part: str) -> dict[str, bytes]:
    """A task's environment/ or tests/ files: from its folder, or generated (held in `info`)."""
    if "path" not in task.info:
        return {name: text.encode() for name, text in task.info["setup" if part == "environment" else part].items()}
    return {name: path.read_bytes() for name, path in files_below(Path(task.info["path"]) / part).items()}


def executables(task: Task) -> list[str]:
    """The setup files to mark executable: a folder's that are; generated scripts run through bash."""
    if "path" not in task.info:
        return []
    return [name for name, path in files_below(Path(task.info["path"]) / "environment").items()
            if path.stat().st_mode & 0o111]


def load_tasks(folder: Path) -> list[Task]:
    """Every task under `folder` (or `folder` itself when it is one task), validated; ValueError
    with one line naming the offending file otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{shown(folder)}: no such task folder")
    if (folder / "task.toml").is_file():
        return [load_task(folder)]
    subfolders = [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith((".", "_"))]
    if not subfolders:
        raise ValueError(f"{shown(folder)}: no tasks (each task is a folder holding {', '.join(REQUIRED)})")
    return [load_task(path) for path in subfolders]
