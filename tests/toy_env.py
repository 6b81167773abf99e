"""An env kind as a third-party package would ship it: a pyproject.toml declaring the entry point
`posttrain.envs: echo = echo_env:EchoEnv`, and the module with the env class and its config.
`write_echo_env(folder, version)` writes the source tree; the tests install it with pip."""

from __future__ import annotations

from pathlib import Path

ECHO_MODULE = '''"""`echo`: repeat the word of the prompt; a package's env kind."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

from envs.base import NO_OUTCOME, RewardFunc, Rubric, SingleTurn, Task

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "ocean", "tiger", "lemon", "piano", "amber", "delta"]


class EchoEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["echo"]


def exact(completion, task, outcome=NO_OUTCOME):
    return float(completion.strip() == task.answer)


class EchoEnv:
    config_class = EchoEnvConfig
    restarts_context = False
    pays_per_step = False
    max_turns = 1
    action_stop = ()

    def __init__(self, config, name="echo"):
        self.config, self.name = config, name
        self.rubric = Rubric([RewardFunc("exact", exact, 1.0)])

    def tasks(self, split, n, seed):
        pool = WORDS[:9] if split == "train" else WORDS[9:]
        return [Task(id=f"{self.name}-{split}-{i}", prompt=f"Repeat the word: {pool[i % len(pool)]}",
                     answer=pool[i % len(pool)]) for i in range(n)]

    def all_tasks(self):
        return self.tasks("train", 9, 0) + self.tasks("eval", 3, 0)

    def start(self, task, llm=None):
        return SingleTurn()

    def oracle_actions(self, task):
        return [task.answer]

    def reference_completion(self, task):
        return task.answer

    def is_correct(self, completion, task, outcome=NO_OUTCOME):
        return exact(completion, task) == 1.0

    def is_formatted(self, completion, task, outcome=NO_OUTCOME):
        return len(completion.split()) == 1
'''

PYPROJECT = '''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "echo-env"
version = "{version}"

[project.entry-points."posttrain.envs"]
echo = "echo_env:EchoEnv"

[tool.setuptools]
packages = ["echo_env"]
'''


def write_echo_env(folder: Path, version: str) -> Path:
    (folder / "echo_env").mkdir(parents=True, exist_ok=True)
    (folder / "echo_env" / "__init__.py").write_text(ECHO_MODULE)
    (folder / "pyproject.toml").write_text(PYPROJECT.format(version=version))
    return folder
