"""`cod`: Connect the Dots (Trinity-RFT) on a grid whose moves are secret code words.

A task is a pack of S goals ("go 2 right 1 up") that share a hidden rule: which of four code
words means up, down, left and right (a permutation fixed per pack). One episode plays the
whole pack: solve goal 0 with no hint (`<moves>ka ka lo</moves>`), read the env's feedback,
write a short `<hints>…</hints>` block, then solve goal 1 in a FRESH context that holds only
its goal and that hint (Turn.restart), and so on. A solve turn earns 1 when the moves end on
the goal; a hint turn earns 0 minus a length penalty past `hint_chars`. `ralph` mode repeats
one goal S times. The outcome holds the reward by position in the pack (`position_j`): the
CoD effect is that it rises with j once hints carry the rule.

Feedback `rule` states the whole rule after every attempt (a hint that copies it solves every
later task); `used` states only the meaning of the codes the attempt used, so knowledge must
build up across hints (and an exploring first attempt pays later).
"""

from __future__ import annotations

import math
import random
import re
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, Check, EnvBase, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn, check_split

DIRECTIONS = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}
CODE_WORDS = ("ba", "ko", "mi", "nu", "pe", "ro", "su", "ti")  # each pack's 4 codes come from these
GOALS = [(dx, dy) for dx in range(-2, 3) for dy in range(-2, 3) if (dx, dy) != (0, 0)]
MAX_PACK = 8  # distinct goals a pack draws (of 24)
MAX_MOVES = 8
EVAL_SHARE = 5  # one rule in EVAL_SHARE is held out: eval packs have rules train never shows
CATALOGUE = 40  # packs per split that `all_tasks` (the oracle check) plays

SOLVE = "Codes {codes} each move 1 step up, down, left or right (secret which).\nHints: {hints}\n" \
        "Go {goal}. Reply <moves>codes</moves>."
FEEDBACK = "\n<feedback>reward {reward}. {revealed}</feedback>\nUpdate <hints>...</hints>\n"
MOVES = "<moves>{moves}</moves>"
HINTS = "<hints>{hints}</hints>"
_MOVES = re.compile(r"<moves>(.*?)</moves>", re.S)
_HINTS = re.compile(r"<hints>(.*?)</hints>", re.S)


class CodEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["cod"]
    pack_size: int = Field(4, ge=1, le=MAX_PACK)  # tasks per pack (S) in the train split
    eval_pack_size: int = Field(8, ge=1, le=MAX_PACK)  # S of the eval split
    mode: Literal["pack", "ralph"] = "pack"  # ralph: one goal repeated S times
    feedback: Literal["rule", "used"] = "rule"  # what the feedback after an attempt reveals
    hint_chars: int = Field(120, ge=16, le=200)  # a longer hint is penalized and cut to this
    hint_length_penalty: float = Field(0.1, ge=0)  # r^z at twice hint_chars (rising linearly past it)
    seed: int = 0  # the world: which rules are held out, which packs are drawn


def goal_text(goal) -> str:
    dx, dy = goal
    parts = ([f"{abs(dx)} {'right' if dx > 0 else 'left'}"] if dx else []) + \
            ([f"{abs(dy)} {'up' if dy > 0 else 'down'}"] if dy else [])
    return " ".join(parts)


def rule_text(rule: dict[str, str], codes=None) -> str:
    """`ba=up ko=left …` sorted by code (the order says nothing about the rule); only `codes` if given."""
    meaning = {code: direction for direction, code in rule.items()}
    return " ".join(f"{code}={meaning[code]}" for code in sorted(codes if codes is not None else meaning))


def solve_prompt(rule: dict[str, str], goal, hints: str) -> str:
    return SOLVE.format(codes=" ".join(sorted(rule.values())), hints=hints or "none", goal=goal_text(goal))


def hint_penalty(hint: str, config: CodEnvConfig) -> float:
    """r^z of a hint: 0 up to hint_chars, then −penalty · (excess / hint_chars), at most −penalty."""
    excess = max(0, len(hint) - config.hint_chars) / config.hint_chars
    return -config.hint_length_penalty * min(1.0, excess)


class CodEpisode:
    """Alternates solve and hint turns over the pack's goals; grades each solve as it comes."""

    def __init__(self, config: CodEnvConfig, task: Task):
        self.config = config
        self.rule = task.info["rule"]  # direction -> code word
        self.goals = [tuple(goal) for goal in task.info["goals"]]
        self.rewards: list[float] = []  # per solved-or-failed goal, in order
        self.well_formed: list[bool] = []  # per action
        self.awaiting = "solve"

    def step(self, action: str) -> Turn:
        if len(self.rewards) == len(self.goals):  # nothing left to do: the loop never gets here
            return Turn(done=True)
        return self._solve(action) if self.awaiting == "solve" else self._hint(action)

    def _solve(self, action: str) -> Turn:
        blocks = _MOVES.findall(action)
        words = blocks[0].split() if len(blocks) == 1 else []
        meaning = {code: direction for direction, code in self.rule.items()}
        valid = len(blocks) == 1 and 0 < len(words) <= MAX_MOVES and all(w in meaning for w in words)
        position = (sum(DIRECTIONS[meaning[w]][0] for w in words), sum(DIRECTIONS[meaning[w]][1] for w in words)) \
            if valid else None
        reward = float(position == self.goals[len(self.rewards)])
        self.rewards.append(reward)
        self.well_formed.append(valid)
        if len(self.rewards) == len(self.goals):
            return Turn(reward=reward, done=True, kind="solve")
        self.awaiting = "hint"
        used = {w for w in words if w in meaning}
        revealed = rule_text(self.rule) if self.config.feedback == "rule" else \
            (rule_text(self.rule, used) if used else "no known code used")
        return Turn(observation=FEEDBACK.format(reward=int(reward), revealed=revealed), reward=reward, kind="solve")

    def _hint(self, action: str) -> Turn:
        blocks = _HINTS.findall(action)
        hint = (blocks[0] if blocks else action).strip()
        self.well_formed.append(len(blocks) == 1 and len(hint) <= self.config.hint_chars)
        self.awaiting = "solve"
        fresh = solve_prompt(self.rule, self.goals[len(self.rewards)], hint[:self.config.hint_chars])
        return Turn(reward=hint_penalty(hint, self.config), restart=fresh, kind="hint")

    def finish(self) -> Outcome:
        """Reward by position in the pack (an unreached task scored 0), the pack's mean, and its format."""
        rewards = self.rewards + [0.0] * (len(self.goals) - len(self.rewards))
        outcome = {f"position_{j}": reward for j, reward in enumerate(rewards)}
        complete = len(self.rewards) == len(self.goals) and all(self.well_formed)
        return {**outcome, "solved": sum(rewards) / len(rewards), "formatted": float(complete)}


def solved(transcript: str, task: Task, outcome: Outcome) -> float:
    """The mean solve reward of the pack, as the episode graded it (the transcript is not trusted)."""
    return outcome["solved"]


def outcome_check(key: str) -> Check:
    """A check of the pack's grade (`solved`, `formatted`): an episode without its outcome fails it."""
    def check(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
        return outcome[key] if outcome else 0.0

    return check


def position_metric(j: int):
    def position(transcript: str, task: Task, outcome: Outcome) -> float:
        return outcome[f"position_{j}"] if len(task.info["goals"]) > j else math.nan  # NaN: no such task

    return RewardFunc(f"position_{j}", position, 0.0)


class CodEnv(EnvBase):
    config_class = CodEnvConfig
    restarts_context = True  # each task of a pack starts a fresh context: not one token sequence
    pays_per_step = True  # every solve turn is paid; the rubric's pack mean is a summary, not paid again
    action_stop = ("</moves>", "</hints>")

    def __init__(self, config: CodEnvConfig, name: str = "cod"):
        super().__init__(config, name)
        self.rubric = Rubric([RewardFunc("solved", solved, 1.0),
                              *(position_metric(j) for j in range(max(config.pack_size, config.eval_pack_size)))],
                             correct=outcome_check("solved"), formatted=outcome_check("formatted"))

    @property
    def max_turns(self) -> int:
        return 2 * max(self.config.pack_size, self.config.eval_pack_size) - 1  # S solves and S−1 hints

    def _held_out(self, rule: dict[str, str]) -> bool:
        return zlib.crc32(f"{self.config.seed}:{rule_text(rule)}".encode()) % EVAL_SHARE == 0

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` packs of a split; a pack's rule decides its split, so the splits share no rule."""
        check_split(split)
        size = self.config.pack_size if split == "train" else self.config.eval_pack_size
        draw = random.Random(f"{self.name}:{split}:{seed}:{self.config.seed}")
        tasks = []
        while len(tasks) < n:
            rule = dict(zip(DIRECTIONS, draw.sample(CODE_WORDS, len(DIRECTIONS))))
            if self._held_out(rule) != (split == "eval"):
                continue
            goals = [draw.choice(GOALS)] * size if self.config.mode == "ralph" else draw.sample(GOALS, size)
            tasks.append(Task(id=f"{self.name}-{split}-{len(tasks)}", prompt=solve_prompt(rule, goals[0], ""),
                              answer=rule_text(rule), info={"rule": rule, "goals": [list(g) for g in goals]}))
        return tasks

    def all_tasks(self) -> list[Task]:
        """The packs are drawn, not shipped: a fixed catalogue of both splits stands for them."""
        return self.tasks("train", CATALOGUE, 0) + self.tasks("eval", CATALOGUE, 0)

    def start(self, task: Task, llm: SubPolicy | None = None) -> CodEpisode:
        return CodEpisode(self.config, task)

    def oracle_actions(self, task: Task) -> list[str]:
        """Every goal solved (the oracle knows the rule, even at the first task) and every hint the rule."""
        rule, actions = task.info["rule"], []
        for k, (dx, dy) in enumerate(task.info["goals"]):
            if k:
                actions.append(HINTS.format(hints=rule_text(rule)))
            moves = [rule["right" if dx > 0 else "left"]] * abs(dx) + [rule["up" if dy > 0 else "down"]] * abs(dy)
            actions.append(MOVES.format(moves=" ".join(moves)))
        return actions

    def reference_completion(self, task: Task) -> str:
        """The oracle's transcript, played through a real episode (as `roll_out` writes it)."""
        episode, transcript = self.start(task), ""
        for action in self.oracle_actions(task):
            turn = episode.step(action)
            transcript += action + turn.transcript()
        episode.finish()
        return transcript
