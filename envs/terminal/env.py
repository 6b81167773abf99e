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
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envs.base import NO_OUTCOME, CatalogueEnv, EnvFieldError, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn
from envs.sandbox import Result, Sandbox, SandboxLimits
from envs.shortcuts import FlawedTeacher
from envs.terminal.catalogue import executables, generated_task, load_tasks, shown, solution_commands, task_files
from envs.terminal.families import GeneratedTerminalTasks
from envs.terminal.shortcuts import shortcut_commands

DATA = Path(__file__).parents[1] / "data" / "terminal"
CALL = "<bash>{command}</bash>"
DONE = "<done/>"
OUTPUT = "\n<output>{text}</output>\n"
_CALL = re.compile(r"<bash>(.*?)</bash>", re.S)
_OBSERVATION = re.compile(r"\n<output>(.*?)</output>\n", re.S)
_FORMATTED = re.compile(r"(?:<bash>(?:(?!</?bash>).)+</bash>\n<output>(?:(?!</output>).)*</output>\n)*"
                        r"(?:(?!<bash>).)*", re.S)
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


def tests_result(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """The correctness check: the hidden tests passed (an ungraded episode passed none)."""
    return outcome["tests_passed"] if "tests_passed" in outcome else 0.0


def well_formed(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """The format check: every action but the last is exactly one `<bash>…</bash>` call (the last
    too, if the turn limit cut it)."""
    return float(bool(_FORMATTED.fullmatch(transcript)))


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
    # the share of tasks whose synthesize-stage oracle teacher acts without inspecting (envs/shortcuts.py)
    teacher_shortcut_rate: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _one_source(self):
        if self.tasks is not None and self.generated is not None:
            raise ValueError("tasks and generated: give one (task folders, or the generated families)")
        return self


class TerminalEnv(FlawedTeacher, CatalogueEnv):
    config_class = TerminalEnvConfig
    action_stop = ("</bash>",)

    def __init__(self, config: TerminalEnvConfig, name: str = "terminal"):
        super().__init__(config, name)
        self.folder = Path(config.tasks) if config.tasks is not None else DATA
        generated = config.generated
        self.catalogue = load_tasks(self.folder) if generated is None else generated.catalogue(generated_task)
        for task in self.catalogue:
            if len(self.oracle_actions(task)) <= self.max_turns:
                continue
            if generated is not None:
                raise EnvFieldError("max_turns", f"{self.max_turns} is fewer than the {task.info['family']} family's "
                                    f"oracle needs ({len(self.oracle_actions(task))} actions)")
            raise ValueError(f"{shown(self.folder / task.id / 'solution' / 'solve.sh')}: the oracle needs "
                             f"more than max_turns={self.max_turns} actions")
        self.rubric = Rubric([RewardFunc("tests", tests_passed, 1.0), RewardFunc("commands", commands_issued, 0.0),
                              RewardFunc("command_errors", command_errors, 0.0)],
                             correct=tests_result, formatted=well_formed)

    def no_tasks(self, split: str) -> str:
        return f"{shown(self.folder)}: no {split} tasks (set split = \"{split}\" in a task.toml)"

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
        return scripted(commands)

    def shortcut_actions(self, task: Task) -> list[str] | None:
        """The teacher's shortcut: its family's, acting without inspecting (envs/terminal/shortcuts.py)."""
        commands = shortcut_commands(task)
        return None if commands is None else scripted(commands)


def scripted(commands: list[str]) -> list[str]:
    """Commands as the policy's actions: one call each, then done."""
    return [CALL.format(command=command) for command in commands] + [DONE]
