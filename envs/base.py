"""The environment protocol: a task dataset, an interaction, and a rubric."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Protocol, Sequence

Outcome = Mapping[str, float]  # what an episode's grader measured after it ended (hidden tests, workspace checks)
NO_OUTCOME: Outcome = {}


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    answer: str
    info: dict = field(default_factory=dict)


def cycled(pool: list[Task], n: int, draw: random.Random) -> list[Task]:
    """`n` tasks from `pool` in a seeded order, passing through it again (reshuffled) when `n` is
    larger; a repeat gets its own id (`<id>-r<pass>`), so ids stay unique in a dataset."""
    tasks: list[Task] = []
    while len(tasks) < n:
        order = list(pool)
        draw.shuffle(order)
        rounds = len(tasks) // len(pool)
        tasks += [replace(task, id=f"{task.id}-r{rounds}") if rounds else task for task in order]
    return tasks[:n]


@dataclass(frozen=True)
class RewardFunc:
    """A named reward function of (transcript, task, outcome); weight 0 makes it a logged metric only.
    `with_ids`: it also takes the completion's token ids (`completion_ids=`), where the caller has
    them. It may return None: "does not apply" (counted, left out of the total, never scored 0)."""

    name: str
    fn: Callable[..., float | None]
    weight: float = 1.0
    with_ids: bool = False
    # scores many (completion, task) at once ahead of `fn` (a reward model's batches, a judge's
    # concurrent requests); `fn` then reads what it kept
    prefetch: Callable[[list], None] | None = None


class RewardShapeError(Exception):
    """A reward function broke its contract (a TRL-style function returned the wrong number of
    values): the stage fails, naming it, rather than scoring on."""


@dataclass
class Score:
    rewards: dict[str, float | None]  # NaN where the function raised, None where it does not apply
    total: float  # NaN when a weighted function raised: never a silent 0
    errors: dict[str, str]

    @property
    def not_applied(self) -> int:
        return sum(value is None for value in self.rewards.values())


Check = Callable[[str, Task, Outcome], float | None]  # a reward function asked whether it gives full marks


def full_marks(value: float | None) -> bool:
    """Whether a check's value passes it: 1 or more (NaN and None, "does not apply", do not)."""
    return value is not None and value >= 1.0


@dataclass(frozen=True)
class Rubric:
    """The env's reward functions (`funcs`, scored and logged) and its two checks: `correct`, whose
    full marks mean the episode solved the task, and `formatted`, whose full marks mean it kept the
    env's format. A check is usually one of the functions' `fn`; one that is neither paid nor logged
    (terminal's format) stays out of `funcs`, so it adds no reward column."""

    funcs: Sequence[RewardFunc]
    correct: Check | None = None
    formatted: Check | None = None  # None: every completion keeps the format

    @classmethod
    def paid_checks(cls, correct: Check, formatted: Check, format_weight: float, *metrics: RewardFunc) -> Rubric:
        """A rubric that pays its checks: `correct` (weight 1) and `format` (`format_weight`), then
        `metrics` (arith, calc, search)."""
        return cls([RewardFunc("correct", correct, 1.0), RewardFunc("format", formatted, format_weight), *metrics],
                   correct=correct, formatted=formatted)

    def is_correct(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        if self.correct is None:
            raise ValueError("the rubric names no correctness check (Rubric(funcs, correct=fn))")
        return full_marks(self.correct(completion, task, outcome))

    def is_formatted(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        return self.formatted is None or full_marks(self.formatted(completion, task, outcome))

    def score(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME,
              completion_ids: list[int] | None = None) -> Score:
        rewards, errors = {}, {}
        for func in self.funcs:
            try:
                value = func.fn(completion, task, outcome, completion_ids) if func.with_ids else \
                    func.fn(completion, task, outcome)
                rewards[func.name] = None if value is None else float(value)
            except RewardShapeError:
                raise
            except Exception as exc:  # reported, counted, never silently 0
                rewards[func.name] = math.nan
                errors[func.name] = f"{type(exc).__name__}: {exc}"
        total = sum(func.weight * rewards[func.name] for func in self.funcs
                    if func.weight != 0 and rewards[func.name] is not None)
        return Score(rewards, total, errors)

    def prefetch(self, items: list[tuple[str, Task]]) -> None:
        """Let the functions that score in batches score these (completion, task) pairs at once;
        what fails there is reported when each is scored."""
        for func in self.funcs:
            if func.prefetch is not None and items:
                try:
                    func.prefetch(items)
                except Exception:  # noqa: BLE001 - scored one by one below, where the error is recorded
                    pass

    def penalties(self, score: Score) -> float:
        """The weighted total of the negative-weight terms only (what an invalid trace still gets)."""
        return sum(f.weight * score.rewards[f.name] for f in self.funcs
                   if f.weight < 0 and score.rewards[f.name] is not None)

    @property
    def reward_range(self) -> tuple[float, float]:
        """Range of the weighted total, given each function's output in [0, 1]."""
        low = sum(min(0.0, f.weight) for f in self.funcs)
        high = sum(max(0.0, f.weight) for f in self.funcs)
        return low, high


RESTART_SEPARATOR = "\n\n=== new context ===\n"  # in a transcript, before the prompt a restarted context begins with


@dataclass(frozen=True)
class Turn:
    """What the environment answers to one action of the policy."""

    observation: str = ""  # appended to the context after the action; env-written, masked from the loss
    reward: float = 0.0  # a per-step reward, on top of the rubric's score of the whole trajectory
    done: bool = False
    # set: the episode's next context starts fresh as this chat prompt instead of growing by the
    # observation (CoD: each task of a pack sees only its own prompt and hint, not the history)
    restart: str | None = None
    kind: str = "action"  # what the turn was, for credit assignment (CoD: "solve" or "hint")

    def transcript(self) -> str:
        """What this answer adds to an episode's transcript: the observation (dropped when the
        episode ends), then a visible separator and the fresh prompt when the context restarts."""
        if self.done:
            return ""
        return self.observation + (RESTART_SEPARATOR + self.restart + "\n" if self.restart is not None else "")


class Episode(Protocol):
    def step(self, action: str) -> Turn:
        """Take the policy's action (the text of one turn) and answer it."""

    def finish(self) -> Outcome:
        """Called once when the episode ends, however it ended (done, turn limit, token cut): grade
        what is left (hidden tests, the workspace) and release what the episode holds (a sandbox)."""


class SubPolicy(Protocol):
    """How an episode reaches a model itself (RLM's `llm_query`): one prompt in, one answer out."""

    def __call__(self, prompt: str) -> str: ...


class SingleTurn:
    """The episode of a single-turn environment: the first action ends it."""

    def step(self, action: str) -> Turn:
        return Turn(done=True)

    def finish(self) -> Outcome:
        return NO_OUTCOME


class EnvFieldError(ValueError):
    """An env config field that cannot be used (a reward function that does not import); the spec
    check prints `envs.<id>.{field}: {message}`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class EnvKindError(Exception):
    """A package's env kind cannot be used: it fails to import or misses part of the protocol
    (envs/loader.py). Defined here so the CLI can catch it without loading the kinds."""


class Environment(Protocol):
    config_class: type  # the pydantic config of the kind (`kind: Literal["<name>"]` + its fields)
    name: str
    rubric: Rubric
    max_turns: int  # actions per episode at most; the episode is cut (truncated) after that
    action_stop: tuple[str, ...]  # strings that end one action (a tool call), besides the end token
    restarts_context: bool  # an episode may start a fresh context (Turn.restart): only per-turn rows train on it
    pays_per_step: bool  # the per-step rewards are the whole reward; the rubric total is not added on top

    def all_tasks(self) -> list[Task]:
        """Every shipped task of both splits (a fixed catalogue where tasks are drawn): what the oracle check plays."""

    def start(self, task: Task, llm: SubPolicy | None = None) -> Episode:
        """A fresh episode of `task`; `llm` answers the episode's own model calls, if it makes any
        (in `step`, never here). The rollout loop starts a few episodes at once, and finishes them
        so, on threads of its own (tasks/rollout/episodes.py): both must be safe to call concurrently."""

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks of a split ('train' or 'eval'); the splits never share a task."""

    def oracle_actions(self, task: Task) -> list[str]:
        """The task's reference solution as the policy's actions, turn by turn (the scripted oracle)."""

    def reference_completion(self, task: Task) -> str:
        """The oracle's transcript of a task (actions and observations; teacher traces, env tests)."""

    def is_correct(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        """Whether the episode solved the task (its final answer, or its graded outcome)."""

    def is_formatted(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        """Whether the completion follows the env's answer format."""


def play_oracle(env: Environment, task: Task, llm: SubPolicy | None = None) -> str:
    """The oracle's transcript of `task`: its actions played through a real episode (sandbox
    included), each followed by the env's answer, as `roll_out` writes `Trajectory.text` for an
    episode whose context is never restarted."""
    episode, transcript = env.start(task, llm), ""
    try:
        for action in env.oracle_actions(task):
            turn = episode.step(action)
            transcript += action + ("" if turn.done else turn.observation)
            if turn.done:
                break
    finally:
        episode.finish()
    return transcript


def teacher_actions(env: Environment, task: Task) -> list[str]:
    """The oracle teacher's actions of a multi-turn env: `teacher_actions` where the class has it
    (EnvBase's), else the oracle's (a package's env that follows only the protocol)."""
    return env.teacher_actions(task) if hasattr(env, "teacher_actions") else env.oracle_actions(task)


def check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")


class EnvBase:
    """The defaults of an env class (the built-in kinds subclass it; `Environment` is the protocol):
    one growing context whose rubric total is paid, no stop string but the end token, the config's
    `max_turns`, the oracle played through a real episode, `is_correct` and `is_formatted` from the
    rubric's checks. A kind states only what differs."""

    rubric: Rubric  # set by the kind, usually from its config (weights)

    restarts_context = False
    pays_per_step = False
    action_stop: tuple[str, ...] = ()
    oracle_llm: SubPolicy | None = None  # what answers the oracle episode's own model calls, if it makes any

    def __init__(self, config, name: str):
        self.config = config
        self.name = name

    @property
    def max_turns(self) -> int:
        return self.config.max_turns

    def draw(self, split: str, seed: int) -> random.Random:
        """The seeded order of a split's tasks: each env name, split and seed its own."""
        return random.Random(f"{self.name}:{split}:{seed}")

    def reference_completion(self, task: Task) -> str:
        """The oracle's transcript, played through a real episode (its sandbox included)."""
        return play_oracle(self, task, self.oracle_llm)

    def teacher_actions(self, task: Task) -> list[str]:
        """What a synthesize stage's oracle teacher plays: the oracle's actions, unless the kind gives
        its teacher a flaw (the mcp env's `teacher_shortcut_rate`); the env's checks play the oracle."""
        return self.oracle_actions(task)

    def is_correct(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        """Full marks from the rubric's correctness check (an error it raises propagates)."""
        return self.rubric.is_correct(completion, task, outcome)

    def is_formatted(self, completion: str, task: Task, outcome: Outcome = NO_OUTCOME) -> bool:
        """Full marks from the rubric's format check, if it names one."""
        return self.rubric.is_formatted(completion, task, outcome)


class CatalogueEnv(EnvBase):
    """An env whose tasks are a fixed catalogue, each marked with its split (info["split"])."""

    catalogue: list[Task]

    def all_tasks(self) -> list[Task]:
        return list(self.catalogue)

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks of a split in a seeded order, cycling (reshuffled each pass) when n exceeds it."""
        check_split(split)
        pool = [task for task in self.catalogue if task.info["split"] == split]
        if not pool:
            raise ValueError(self.no_tasks(split))
        return cycled(pool, n, self.draw(split, seed))

    def no_tasks(self, split: str) -> str:
        """The error when a split has no task."""
        return f"the {split} split of {self.name} has no tasks"
