"""`terminal`: shell tasks in a bubblewrap sandbox, in the Terminal-Bench/Harbor task-folder shape.

A task is a folder (its name is the task's id): `instruction.md` (the prompt); `task.toml`
(Harbor's `[agent]`/`[verifier] timeout_sec`, `[environment] cpus, memory_mb, storage_mb,
allow_internet = false`, `[metadata]`, and our top-level `split = "train" | "eval"`); optional
`environment/` (setup files copied into the workspace /work at the start); `tests/test.sh` (the
hidden check: copied to /grader/tests only after the episode ended and run in the same sandbox
by `Sandbox.grade`, from /grader with $TESTS_DIR, where the policy cannot have planted a module
or config the check would pick up; exit code 0 = passed); `solution/solve.sh` (the oracle, one
command per line, each line one action).

The policy writes one command per action, `<bash>wc -l data.txt</bash>`, and the env answers
`\n<output>6 data.txt\n[exit code 0]</output>\n`; an action without a call (`<done/>`) ends it.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envs.base import NO_OUTCOME, EnvFieldError, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn, draw_split, play_oracle
from envs.sandbox import Result, Sandbox, SandboxLimits
from envs.task_files import files_below
from envs.terminal_families import GeneratedTerminalTasks, variant

DATA = Path(__file__).with_name("data") / "terminal"
REMINDER = "\nRun one shell command per turn as <bash>COMMAND</bash>; write <done/> when finished."
CALL = "<bash>{command}</bash>"
DONE = "<done/>"
OUTPUT = "\n<output>{text}</output>\n"
REQUIRED = ("instruction.md", "task.toml", "tests/test.sh", "solution/solve.sh")
_CALL = re.compile(r"<bash>(.*?)</bash>", re.S)
_OBSERVATION = re.compile(r"\n<output>(.*?)</output>\n", re.S)
_FORMATTED = re.compile(r"(?:<bash>(?:(?!</?bash>).)+</bash>\n<output>(?:(?!</output>).)*</output>\n)*"
                        r"(?:(?!<bash>).)*", re.S)
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


def _shown(path: Path) -> str:
    """A path as errors name it: relative to the working directory where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{_shown(path)}: unreadable ({exc})") from None


def read_task_toml(path: Path) -> TaskToml:
    try:
        data = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as exc:
        position = _TOML_POSITION.match(str(exc))
        detail = f"line {position.group(2)}: {position.group(1)}" if position else str(exc)
        raise ValueError(f"{_shown(path)}: invalid TOML ({detail})") from None
    try:
        return TaskToml.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})" for e in exc.errors())
        raise ValueError(f"{_shown(path)}: {problems}") from None


def solution_commands(path: Path) -> list[str]:
    """The oracle's commands: the non-empty, non-comment lines of solve.sh, one action each."""
    commands = []
    for number, line in enumerate(_read(path).splitlines(), 1):
        command = line.strip()
        if not command or command.startswith("#"):
            continue
        if command.endswith("\\") or _HEREDOC.search(command):
            raise ValueError(f"{_shown(path)}:{number}: a command spans lines; write one whole command per line")
        commands.append(command)
    if not commands:
        raise ValueError(f"{_shown(path)}: no commands (one shell command per line)")
    return commands


def load_task(folder: Path) -> Task:
    files = files_below(folder)  # refuses a symlink anywhere in the task folder, naming it
    for name in REQUIRED:
        if name not in files:
            raise ValueError(f"{_shown(folder / name)}: missing (a task folder holds {', '.join(REQUIRED)})")
    config = read_task_toml(folder / "task.toml")
    instruction = _read(folder / "instruction.md").strip()
    if not instruction:
        raise ValueError(f"{_shown(folder / 'instruction.md')}: empty")
    solution_commands(folder / "solution" / "solve.sh")
    return Task(id=folder.name, prompt=instruction + REMINDER, answer="",
                info={"path": str(folder.resolve()), "split": config.split, "agent_timeout_sec": config.agent.timeout_sec,
                      "verifier_timeout_sec": config.verifier.timeout_sec, "memory_mb": config.environment.memory_mb,
                      "storage_mb": config.environment.storage_mb})


def generated_task(family: str, split: str, index: int, seed: int) -> Task:
    """Variant `index` of a generated family (envs/terminal_families.py) as a task; its files
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
        raise ValueError(f"{_shown(folder)}: no such task folder")
    if (folder / "task.toml").is_file():
        return [load_task(folder)]
    subfolders = [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith((".", "_"))]
    if not subfolders:
        raise ValueError(f"{_shown(folder)}: no tasks (each task is a folder holding {', '.join(REQUIRED)})")
    return [load_task(path) for path in subfolders]


def _observation(result: Result) -> str:
    # a literal closing tag in the output would end the observation early for whoever parses the transcript
    output = result.output.replace("\x00", "").replace("</output>", "<\\/output>")
    return OUTPUT.format(text=replace(result, output=output).observation())


class TerminalEpisode:
    """One task in its own sandbox: setup files in /work, commands in, hidden tests at the end."""

    def __init__(self, task: Task, limits: SandboxLimits):
        self.task = task
        self.verifier_seconds = min(task.info["verifier_timeout_sec"], limits.wall_seconds)
        self.sandbox = Sandbox(limits, files=task_files(task, "environment"))
        executable = [shlex.quote(name) for name in executables(task)]
        if executable:
            self.sandbox.run("chmod +x -- " + " ".join(executable))
        self.outcome: Outcome | None = None  # set once, by finish

    def step(self, action: str) -> Turn:
        call = _CALL.search(action)
        if call is None:
            return Turn(done=True)
        command = call.group(1)
        if "\x00" in command:  # bash -c cannot take it (and the sandbox's agent dies on it)
            return Turn(observation=OUTPUT.format(text="[error: the command holds a NUL byte]"))
        try:
            result = self.sandbox.run(command)
        except Exception as exc:  # a broken sandbox answers with an error, never an exception out of step
            result = Result("", None, f"{type(exc).__name__}: {exc}")
        return Turn(observation=_observation(result))

    def finish(self) -> Outcome:
        if self.outcome is None:
            try:
                self.outcome = {"tests_passed": float(self._run_tests())}
            except Exception:  # a sandbox the policy broke fails its tests
                self.outcome = {"tests_passed": 0.0}
            finally:
                self.sandbox.close()
        return self.outcome

    def _run_tests(self) -> bool:  # test.sh's output is not kept: the outcome is its exit code
        tests = task_files(self.task, "tests")
        command = f'timeout {self.verifier_seconds:g} bash "$TESTS_DIR/test.sh" >/dev/null 2>&1'
        result = self.sandbox.grade(tests, command)
        return result.error is None and result.exit_code == 0


def tests_passed(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    if "tests_passed" not in outcome:
        raise ValueError("no graded outcome: the terminal reward needs the episode's outcome (tests_passed)")
    return float(outcome["tests_passed"])


def commands_issued(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    actions = _OBSERVATION.split(transcript)[0::2]  # the odd items are the (captured) observations
    return float(sum(1 for action in actions if _CALL.search(action)))


def command_errors(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """Commands that failed: a non-zero exit code, a timeout, or a sandbox error."""
    return float(sum(1 for text in _OBSERVATION.findall(transcript)
                     if text.rsplit("\n", 1)[-1] != "[exit code 0]"))


class TerminalEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["terminal"]
    tasks: str | None = None  # a folder of task folders; None: the ones shipped in envs/data/terminal
    generated: GeneratedTerminalTasks | None = None  # tasks drawn from the generated families instead of folders
    max_turns: int = Field(6, ge=2)
    # the upper bounds; a task's task.toml may only lower them (agent timeout, memory, storage)
    sandbox: SandboxLimits = SandboxLimits(cpu_seconds=5, wall_seconds=5.0, memory_mb=512, processes=32,
                                           file_size_mb=4, disk_mb=16, output_bytes=256)

    @model_validator(mode="after")
    def _one_source(self):
        if self.tasks is not None and self.generated is not None:
            raise ValueError("tasks and generated: give one (task folders, or the generated families)")
        return self


class TerminalEnv:
    config_class = TerminalEnvConfig
    restarts_context = False
    pays_per_step = False
    action_stop = ("</bash>",)

    def __init__(self, config: TerminalEnvConfig, name: str = "terminal"):
        self.config = config
        self.name = name
        self.max_turns = config.max_turns
        self.folder = Path(config.tasks) if config.tasks is not None else DATA
        generated = config.generated
        self._tasks = load_tasks(self.folder) if generated is None else generated.catalogue(generated_task)
        for task in self._tasks:
            if len(self.oracle_actions(task)) <= self.max_turns:
                continue
            if generated is not None:
                raise EnvFieldError("max_turns", f"{self.max_turns} is fewer than the {task.info['family']} family's "
                                    f"oracle needs ({len(self.oracle_actions(task))} actions)")
            raise ValueError(f"{_shown(self.folder / task.id / 'solution' / 'solve.sh')}: the oracle needs "
                             f"more than max_turns={self.max_turns} actions")
        self.rubric = Rubric([RewardFunc("tests", tests_passed, 1.0), RewardFunc("commands", commands_issued, 0.0),
                              RewardFunc("command_errors", command_errors, 0.0)])

    def all_tasks(self) -> list[Task]:
        return list(self._tasks)

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks of a split in a seeded order, cycling (reshuffled each pass) when n exceeds it."""
        return draw_split(self._tasks, split, n, f"{self.name}:{split}:{seed}",
                          f"{_shown(self.folder)}: no {split} tasks (set split = \"{split}\" in a task.toml)")

    def limits(self, task: Task) -> SandboxLimits:
        """The config's sandbox limits, lowered by the task's own (agent timeout, memory, storage)."""
        base = self.config.sandbox
        return base.model_copy(update={"wall_seconds": min(base.wall_seconds, task.info["agent_timeout_sec"]),
                                       "memory_mb": min(base.memory_mb, task.info["memory_mb"]),
                                       "disk_mb": min(base.disk_mb, task.info["storage_mb"])})

    def start(self, task: Task, llm: SubPolicy | None = None) -> TerminalEpisode:
        return TerminalEpisode(task, self.limits(task))

    def oracle_actions(self, task: Task) -> list[str]:
        commands = (task.info["solution"] if "path" not in task.info else
                    solution_commands(Path(task.info["path"]) / "solution" / "solve.sh"))
        return [CALL.format(command=command) for command in commands] + [DONE]

    def reference_completion(self, task: Task) -> str:
        """The oracle's transcript, played through a real episode (its sandbox included)."""
        return play_oracle(self, task)

    def is_correct(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        return "tests_passed" in outcome and outcome["tests_passed"] == 1.0

    def is_formatted(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        """Every action but the last is exactly one `<bash>…</bash>` call (the last too, if the turn limit cut it)."""
        return bool(_FORMATTED.fullmatch(completion))
