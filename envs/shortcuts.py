"""Teachers with fixable flaws: on a fixed share of the tasks, a synthesize stage's oracle teacher
takes a plausible shortcut that fails (acts without inspecting: edits before reading the file,
answers from the first search hit, answers without running the code that checks), while the
family's other tasks show the right move. SFT imitates the mixture; only the env's outcome
reward, on the model's own samples, tells the shortcut from the right move.

The share is the env config's `teacher_shortcut_rate`; which tasks take it is fixed by the task's
id, so every env instance (and every run) makes the same choice. The env's checks
(`posttrain envs check`, tasks/rollout/env_check.py) play `oracle_actions`, never the shortcut.
"""

from __future__ import annotations

import random
from typing import Callable

from envs.base import Task


def takes_shortcut(task: Task, rate: float) -> bool:
    """Whether the flawed teacher takes its shortcut on `task`: a fixed draw per task id."""
    return random.Random(f"shortcut:{task.id}").random() < rate


def guess_draw(task: Task) -> random.Random:
    """The seeded draw of a shortcut's guesses (a number, a word): the same for a task every time."""
    return random.Random(f"guess:{task.id}")


def guessed(draw: Callable[[], str], wrong: Callable[[str], bool]) -> str:
    """The first drawn guess that is wrong (`wrong(guess)`): a shortcut never lands on the answer."""
    while True:
        guess = draw()
        if wrong(guess):
            return guess


class FlawedTeacher:
    """What an env class with a flawed teacher adds (before its EnvBase): `teacher_actions`, the
    shortcut on the config's `teacher_shortcut_rate` share of the tasks where the task's family
    has one, else the oracle's; the class says what the shortcut is (`shortcut_actions`)."""

    def teacher_actions(self, task: Task) -> list[str]:
        if takes_shortcut(task, self.config.teacher_shortcut_rate):
            actions = self.shortcut_actions(task)
            if actions is not None:
                return actions
        return self.oracle_actions(task)

    def shortcut_actions(self, task: Task) -> list[str] | None:
        """The task's failing shortcut as the policy's actions; None where its family has none."""
        raise NotImplementedError
