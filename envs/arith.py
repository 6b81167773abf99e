"""`arith`: single-turn verifiable arithmetic ("what is 27+15?") with a fixed answer format."""

from __future__ import annotations

import random
import re
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, Outcome, RewardFunc, Rubric, Task, check_split
from envs.single_turn import SingleTurnEnv

PROMPT = "I have a great question: what is {a}{op}{b}?"
COMPLETION = "Fantastic question! Let me unpack this for you. We have {a} {op} {b} = {c}.{checks} The final answer is {c}."
SELF_CHECK = " The answer is correct."
_FINAL = re.compile(r"The final answer is (-?\d+)")
_FORMAT = re.compile(r"Fantastic question! Let me unpack this for you\. We have (\d+) ([+-]) (\d+) = (-?\d+)\."
                     r"(?: The answer is correct\.)* The final answer is (-?\d+)\.")
EVAL_SHARE = 10  # one pair in EVAL_SHARE goes to the held-out split


class ArithEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["arith"]
    digits: int = Field(2, ge=1, le=3)
    ops: list[Literal["+", "-"]] = Field(["+"], min_length=1)
    format_weight: float = Field(0.2, ge=0)
    # The oracle's trace re-checks its sum ("The answer is correct.") before answering, as
    # reasoning traces do: after each check, another follows with this probability (the count
    # is fixed per problem). Above 0.5, "check again" is the likelier next step at every point,
    # so greedy decoding of a model that learned the traces well repeats it forever: the doom
    # loop that sampling escapes and on-policy preference training removes.
    self_check_rate: float = Field(0.0, ge=0, lt=1)
    # A teacher right only part of the time: on this share of the problems whose units carry (a
    # fixed choice per problem), its traces forget the carry (27+15 = 32) and answer that. SFT
    # imitates the slips; rl, whose reward checks every answer, trains them away. The env's own
    # checks (`oracle_actions`, `posttrain envs check`) always play the right sum.
    teacher_slip_rate: float = Field(0.0, ge=0, le=1)


def final_answers(completion: str) -> list[str]:
    return _FINAL.findall(completion)


def correctness(completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """1 when there is exactly one final answer and it is right (answer spam does not pay)."""
    answers = final_answers(completion)
    return float(len(answers) == 1 and answers[0] == task.answer)


def format_ok(completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    match = _FORMAT.fullmatch(completion.strip())
    return float(bool(match) and match.group(4) == match.group(5))


def completion_words(completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return float(len(completion.split()))


class ArithEnv(SingleTurnEnv):
    config_class = ArithEnvConfig

    def __init__(self, config: ArithEnvConfig, name: str = "arith"):
        super().__init__(config, name)
        self.rubric = Rubric.paid_checks(correctness, format_ok, config.format_weight,
                                         RewardFunc("words", completion_words, 0.0))

    def _in_split(self, a: int, b: int, op: str, split: str) -> bool:
        held_out = zlib.crc32(f"{a}{op}{b}".encode()) % EVAL_SHARE == 0
        return held_out if split == "eval" else not held_out

    def split_problems(self, split: str) -> list[tuple[int, str, int]]:
        check_split(split)
        digits = self.config.digits
        numbers = range(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits)
        return [(a, op, b) for op in self.config.ops for a in numbers for b in numbers
                if not (op == "-" and b > a) and self._in_split(a, b, op, split)]

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` distinct tasks of a split in seeded order (cycling when the split is smaller)."""
        problems = self.split_problems(split)
        self.draw(split, seed).shuffle(problems)
        tasks = []
        for i in range(n):
            a, op, b = problems[i % len(problems)]
            answer = a + b if op == "+" else a - b
            tasks.append(Task(id=f"{self.name}-{split}-{i}", prompt=PROMPT.format(a=a, op=op, b=b),
                              answer=str(answer), info={"a": a, "b": b, "op": op}))
        return tasks

    def all_tasks(self) -> list[Task]:
        """Every problem of both splits."""
        return [task for split in ("train", "eval") for task in self.tasks(split, len(self.split_problems(split)), 0)]

    def oracle_answer(self, task: Task) -> str:
        """The right sum in the teacher's words (its self-checks, never its slips)."""
        return self._trace(task, int(task.answer))

    def reference_completion(self, task: Task) -> str:
        """The teacher's trace, which synthesize trains on: slips included."""
        return self._trace(task, self.teacher_answer(task))

    def teacher_answer(self, task: Task) -> int:
        """The task's answer, or the teacher's slip: the sum without its carry."""
        a, op, b = task.info["a"], task.info["op"], task.info["b"]
        carries = op == "+" and a % 10 + b % 10 >= 10
        if carries and random.Random(f"slip:{a}{op}{b}").random() < self.config.teacher_slip_rate:
            return int(task.answer) - 10
        return int(task.answer)

    def _trace(self, task: Task, answer: int) -> str:
        a, op, b = task.info["a"], task.info["op"], task.info["b"]
        draws = random.Random(f"checks:{a}{op}{b}")
        checks = 0
        while draws.random() < self.config.self_check_rate:
            checks += 1
        return COMPLETION.format(a=a, op=op, b=b, c=answer, checks=SELF_CHECK * checks)
