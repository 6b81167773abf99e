"""`calc`: multi-turn arithmetic with a calculator tool ("what is 27+15+38?").

The policy calls the tool with `<calc>27+15</calc>` (the action ends at `</calc>`); the
environment answers `<result>42</result>` (env-written, masked from the loss) and the policy
goes on, until it writes an action without a call: its final answer. The smallest env that
exercises the multi-turn protocol, per-step rows (StepPO) and observation masking.
"""

from __future__ import annotations

import re
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, EnvBase, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn, check_split

PROMPT = "Use the calculator: what is {expression}?"
CALL = "<calc>{expression}</calc>"
RESULT = "\n<result>{value}</result>\n"
FINAL = "The final answer is {value}."
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_TERM = re.compile(r"\s*([+-]?)\s*(\d{1,12})\s*")
_FINAL = re.compile(r"The final answer is (-?\d+)")
_FORMAT = re.compile(r"(?:<calc>[^<]*</calc>\n<result>-?\d+</result>\n)+The final answer is -?\d+\.")
EVAL_SHARE = 10  # one problem in EVAL_SHARE goes to the held-out split
CATALOGUE = 500  # train tasks `posttrain envs check` plays


class CalcEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["calc"]
    operands: int = Field(3, ge=2, le=6)
    digits: int = Field(2, ge=1, le=4)
    max_turns: int = Field(6, ge=2)
    format_weight: float = Field(0.2, ge=0)


def evaluate_sum(expression: str) -> int:
    """Value of a sum/difference of integers ("27+15-3"); ValueError for anything else."""
    terms, position = [], 0
    while position < len(expression):
        match = _TERM.match(expression, position)
        if not match or match.end() == position or (terms and not match.group(1)):
            raise ValueError(f"not a sum of integers: {expression!r}")
        terms.append(-int(match.group(2)) if match.group(1) == "-" else int(match.group(2)))
        position = match.end()
    if not terms:
        raise ValueError("empty expression")
    return sum(terms)


class CalcEpisode:
    def step(self, action: str) -> Turn:
        call = _CALL.search(action)
        if call is None:
            return Turn(done=True)
        try:
            return Turn(observation=RESULT.format(value=evaluate_sum(call.group(1))))
        except ValueError as exc:
            return Turn(observation=f"\n<error>{exc}</error>\n")

    def finish(self) -> Outcome:
        return NO_OUTCOME


def correctness(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """1 when the transcript holds exactly one final answer and it is right (answer spam does not pay)."""
    answers = _FINAL.findall(transcript)
    return float(len(answers) == 1 and answers[0] == task.answer)


def format_ok(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return float(bool(_FORMAT.fullmatch(transcript.strip())))


def tool_calls(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return float(len(_CALL.findall(transcript)))


class CalcEnv(EnvBase):
    config_class = CalcEnvConfig
    action_stop = ("</calc>",)

    def __init__(self, config: CalcEnvConfig, name: str = "calc"):
        super().__init__(config, name)
        self.rubric = Rubric.paid_checks(correctness, format_ok, config.format_weight,
                                         RewardFunc("tool_calls", tool_calls, 0.0))

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks of a split, drawn at random (the splits are disjoint by a hash of the problem)."""
        check_split(split)
        draw = self.draw(split, seed)
        low, high = (0 if self.config.digits == 1 else 10 ** (self.config.digits - 1)), 10 ** self.config.digits - 1
        tasks = []
        while len(tasks) < n:
            operands = [draw.randint(low, high) for _ in range(self.config.operands)]
            expression = "+".join(map(str, operands))
            held_out = zlib.crc32(expression.encode()) % EVAL_SHARE == 0
            if held_out == (split == "eval"):
                tasks.append(Task(id=f"{self.name}-{split}-{len(tasks)}", prompt=PROMPT.format(expression=expression),
                                  answer=str(sum(operands)), info={"operands": operands}))
        return tasks

    def all_tasks(self) -> list[Task]:
        """The tasks are drawn, not shipped: a fixed catalogue of both splits stands for them."""
        return self.tasks("train", CATALOGUE, 0) + self.tasks("eval", CATALOGUE // EVAL_SHARE, 0)

    def start(self, task: Task, llm: SubPolicy | None = None) -> CalcEpisode:
        return CalcEpisode()

    def oracle_actions(self, task: Task) -> list[str]:
        """The reference solution as actions: add the operands one call at a time, then answer."""
        operands = task.info["operands"]
        total, actions = operands[0], []
        for operand in operands[1:]:
            actions.append(CALL.format(expression=f"{total}+{operand}"))
            total += operand
        return [*actions, FINAL.format(value=total)]
