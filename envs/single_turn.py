"""`SingleTurnEnv`: the base of a kind whose episode is one answer to one prompt (arith, dataset).

A kind supplies its tasks (`tasks`, `all_tasks`), its `rubric` (its correctness and format checks
named) and the oracle's answer to a task; the one-turn episode, the turn limit and the oracle's
actions and transcript come from here, `is_correct` and `is_formatted` from EnvBase.
"""

from __future__ import annotations

from envs.base import EnvBase, SingleTurn, SubPolicy, Task


class SingleTurnEnv(EnvBase):
    max_turns = 1

    def start(self, task: Task, llm: SubPolicy | None = None) -> SingleTurn:
        return SingleTurn()

    def oracle_answer(self, task: Task) -> str:
        """The reference answer to `task`."""
        raise NotImplementedError(f"{type(self).__name__} gives no oracle answer")

    def oracle_actions(self, task: Task) -> list[str]:
        return [self.oracle_answer(task)]

    def reference_completion(self, task: Task) -> str:
        """The oracle's transcript: its answer alone (the first action ends the episode)."""
        return self.oracle_answer(task)
