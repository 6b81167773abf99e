"""`rlm`: Recursive Language Models: a query over a long input the policy never sees whole.

The input (20k-60k chars, far beyond the model's 512 positions) is the variable `context` of a
sandboxed Python REPL; the prompt holds only the query and the context's kind and length. Each
action is a code cell, `<repl>code</repl>`, answered with its output, `<output>...</output>`
(truncated). In a cell, `llm_query(prompt)` asks the episode's own model (depth 1: a plain
completion), counted and limited. `FINAL(answer)` or `FINAL_VAR(variable)` outside code ends the
episode with that answer, an action with neither code nor a final ends it unanswered. The episode
grades its answer when it finishes, so the rubric reads the outcome (a FINAL_VAR answer lives in
the REPL, not in the transcript). Tasks are generated from a seed: counts, lookups and sums over a
log (how many lines, which amount, sum, largest, first id), a code hidden in filler text, how often
the text mentions a thing, and a note that code finds and a sub-call reads (`ask`).
"""

from __future__ import annotations

import functools
import random
import re
from typing import Callable, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, CatalogueEnv, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn
from envs.sandbox import Result, Sandbox, SandboxLimits, SandboxUnavailable
from envs.shortcuts import FlawedTeacher, guess_draw, guessed

FAMILIES = ("count", "lookup", "sum", "largest", "first", "needle", "ask", "mentions")
LOG_FAMILIES = ("count", "lookup", "sum", "largest", "first")
EVAL_SHARE = 10  # one round of families in EVAL_SHARE goes to the held-out split
USERS = ("ann", "bob", "cid", "dan", "eve", "fay")
STATUSES = ("ok", "ok", "ok", "error", "retry")
PLACES = ("harbor", "library", "station", "market", "museum", "bakery", "stadium", "castle")
MEETINGS = ("see you at the", "let's meet by the", "I will wait at the", "meet me near the")
SUBJECTS = ("the cat", "a farmer", "the river", "my neighbour", "the old clock", "a small bird")
VERBS = ("watched", "followed", "forgot", "painted", "carried", "heard")
OBJECTS = ("the moon", "a blue kite", "the garden", "an empty box", "the bridge", "a letter")
TAILS = ("yesterday", "at dawn", "again", "quietly", "for hours", "by chance")
CODE_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
KINDS = {"log": "a log, one `id=.. user=.. status=.. amount=..` per line", "text": "a long text"}
PARSE_LOG = "rows = [dict(f.split('=') for f in l.split()) for l in context.splitlines()]\n"
PROMPT = ("{query}\n`context` is {kind}, {chars} chars. Run Python as <repl>code</repl>; llm_query(prompt) "
          "asks a model (at most {calls} calls). End with FINAL(answer) or FINAL_VAR(variable).")
ORACLE_CELL = "<repl>{code}\nprint(n)</repl>"
ORACLE_FINAL = "FINAL_VAR(n)"
_CELL = re.compile(r"<repl>(.*?)</repl>", re.S)
_FINAL = re.compile(r"\bFINAL(_VAR)?\((.*?)\)")
_ANSWER_EDGES = re.compile(r"^[\s\"'`]+|[\s\"'`.]+$")
_NOTE_PLACE = re.compile(r"Note from \w+: [^.]*?\b(" + "|".join(PLACES) + r")\b")
# A refused llm_query reaches the cell as an answer with this prefix, which SETUP_CELL's wrapper
# raises there (the sandbox passes the host's answers through, not its errors).
REFUSED = "\x00"
SETUP_CELL = f"""def llm_query(prompt, _ask=llm_query):
    answer = _ask(prompt)
    if answer.startswith({REFUSED!r}):
        raise RuntimeError(answer[1:])
    return answer
_rlm_ready = True"""


class RlmEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["rlm"]
    context_chars: int = Field(30000, ge=1000)  # each context is 2/3 to 2 times this long
    max_turns: int = Field(4, ge=2)
    max_llm_calls: int = Field(4, ge=0)  # llm_query calls per episode
    query_chars: int = Field(1000, ge=1)  # longest llm_query prompt: the sub-model's window is small too
    output_chars: int = Field(300, ge=20)  # what the policy sees of one cell's output
    sandbox: SandboxLimits = SandboxLimits()
    tasks: int = Field(500, ge=2 * len(FAMILIES))  # the generated catalogue, both splits
    seed: int = 0
    # the share of tasks whose synthesize-stage oracle teacher answers without running code (envs/shortcuts.py)
    teacher_shortcut_rate: float = Field(0.0, ge=0, le=1)


class Generated(NamedTuple):
    kind: str
    context: str
    query: str
    answer: str
    code: str  # the oracle's cell: leaves the answer in `n`


def _log_task(family: str, draw: random.Random, chars: int) -> Generated:
    rows, lines, size, line_id = [], [], 0, 1000
    while size < chars:
        line_id += draw.randint(1, 5)
        row = {"id": str(line_id), "user": draw.choice(USERS), "status": draw.choice(STATUSES),
               "amount": str(draw.randint(1, 99))}
        rows.append(row)
        lines.append(" ".join(f"{key}={value}" for key, value in row.items()))
        size += len(lines[-1]) + 1
    if family == "count":
        field = draw.choice(("status", "user"))
        value = draw.choice(("error", "retry") if field == "status" else USERS)
        query, answer = f"How many lines have {field}={value}?", sum(r[field] == value for r in rows)
        code = f"n = sum(r['{field}'] == '{value}' for r in rows)"
    elif family == "lookup":
        row = draw.choice(rows)
        query, answer = f"What amount does the line with id={row['id']} have?", row["amount"]
        code = f"n = [r['amount'] for r in rows if r['id'] == '{row['id']}'][0]"
    elif family == "sum":
        user = draw.choice(USERS)
        query, answer = f"What is the sum of amounts for user {user}?", sum(int(r["amount"]) for r in rows
                                                                            if r["user"] == user)
        code = f"n = sum(int(r['amount']) for r in rows if r['user'] == '{user}')"
    elif family == "largest":
        user = draw.choice(USERS)
        query, answer = f"What is the largest amount for user {user}?", max(int(r["amount"]) for r in rows
                                                                             if r["user"] == user)
        code = f"n = max(int(r['amount']) for r in rows if r['user'] == '{user}')"
    else:
        status = draw.choice(("error", "retry"))
        query, answer = f"What is the id of the first line with status={status}?", next(
            r["id"] for r in rows if r["status"] == status)
        code = f"n = [r['id'] for r in rows if r['status'] == '{status}'][0]"
    return Generated("log", "\n".join(lines), query, str(answer), PARSE_LOG + code)


def _text_task(family: str, draw: random.Random, chars: int) -> Generated:
    sentences, size = [], 0
    while size < chars:
        sentence = f"{draw.choice(SUBJECTS)} {draw.choice(VERBS)} {draw.choice(OBJECTS)} {draw.choice(TAILS)}."
        sentences.append(sentence[0].upper() + sentence[1:])
        size += len(sentence) + 1
    if family == "needle":
        answer = "".join(draw.choice(CODE_CHARS) for _ in range(5))
        hidden, query = [f"The secret code is {answer}."], "What is the secret code?"
        code = "n = context.split('The secret code is ')[1].split('.')[0]"
    elif family == "mentions":
        thing = draw.choice(OBJECTS)
        hidden, query = [], f"How many times does the text mention {thing}?"
        code = f"n = context.count('{thing}')"
    else:  # the note is found by code and read by a sub-call
        people, places = draw.sample(USERS, 3), draw.sample(PLACES, 3)
        hidden = [f"Note from {person}: {draw.choice(MEETINGS)} {place}." for person, place in zip(people, places)]
        query, answer = f"Where does {people[0]} want to meet?", places[0]
        code = f"i = context.find('Note from {people[0]}:')\nn = llm_query('Where to meet? ' + context[i:i+60])"
    for sentence in hidden:
        sentences.insert(draw.randrange(len(sentences) + 1), sentence)
    context = " ".join(sentences)
    if family == "mentions":
        answer = str(context.count(thing))
    return Generated("text", context, query, answer, code)


@functools.lru_cache(maxsize=16)
def generate(family: str, seed: str, context_chars: int) -> Generated:
    """A task's context, query, answer and oracle cell, the same every time for the same seed."""
    draw = random.Random(f"rlm:{seed}")
    chars = draw.randint(context_chars * 2 // 3, context_chars * 2)
    return (_log_task if family in LOG_FAMILIES else _text_task)(family, draw, chars)


def oracle_llm(prompt: str) -> str:
    """The sub-model the `ask` oracle assumes: it names the meeting place of the note it is shown."""
    match = _NOTE_PLACE.search(prompt)
    return match.group(1) if match else "I don't know."


def normalize(answer: str) -> str:
    """Case, surrounding quotes, a final period and spacing do not matter; nor does `42.0` vs `42`."""
    text = " ".join(_ANSWER_EDGES.sub("", answer).lower().split())
    try:
        number = float(text)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else text


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [truncated]"


class SubCalls:
    """The episode's llm_query on the host: counted, limited, prompts capped; refusals are raised in the cell."""

    def __init__(self, llm: SubPolicy | None, limit: int, prompt_chars: int):
        self.llm, self.limit, self.prompt_chars = llm, limit, prompt_chars
        self.calls = 0  # those that reached the model

    def __call__(self, prompt: str) -> str:
        if self.llm is None:
            return REFUSED + "llm_query is not available in this episode"
        if len(prompt) > self.prompt_chars:
            return REFUSED + f"llm_query prompt too long: {len(prompt)} chars, at most {self.prompt_chars}"
        if self.calls >= self.limit:
            return REFUSED + f"llm_query limit reached: {self.limit} calls per episode"
        self.calls += 1
        try:
            return str(self.llm(prompt)).lstrip(REFUSED)
        except Exception as exc:  # a failing model call is the cell's error, never the rollout's
            return REFUSED + f"llm_query failed: {type(exc).__name__}: {exc}"


class RlmEpisode:
    def __init__(self, task: Task, context: str, config: RlmEnvConfig, llm: SubPolicy | None):
        self.task, self.context, self.output_chars = task, context, config.output_chars
        self.sub_calls = SubCalls(llm, config.max_llm_calls, config.query_chars)
        self.cells, self.answer = 0, None  # the answer: set by FINAL / FINAL_VAR
        self.sandbox = Sandbox(config.sandbox, llm=self.sub_calls)
        error = self._seed()
        if self.sandbox.stopped or error:
            self.sandbox.close()
            raise SandboxUnavailable(f"the sandbox did not start: {self.sandbox.stopped or error}")

    def step(self, action: str) -> Turn:
        cells = _CELL.findall(action)
        final = _FINAL.search(_CELL.sub("", action).split("<repl>")[0])  # FINAL inside code is code
        observation = "".join(self._observation(self._run(code)) for code in cells)
        if final is not None:
            self.answer = self._resolve(final.group(2).strip()) if final.group(1) else final.group(2)
        return Turn(observation=observation, done=final is not None or not cells or bool(self.sandbox.stopped))

    def finish(self) -> Outcome:
        try:
            answered = self.answer is not None
            correct = answered and normalize(self.answer) == normalize(self.task.answer)
            return {"correct": float(correct), "answered": float(answered),
                    "llm_calls": float(self.sub_calls.calls), "cells": float(self.cells)}
        finally:
            self.sandbox.close()

    def _seed(self) -> str | None:
        """Puts `context` and the llm_query wrapper in the namespace; the error, if that failed."""
        self.sandbox.set_variables({"context": self.context})
        return self.sandbox.run_python(SETUP_CELL).error

    def _run(self, code: str) -> Result:
        self.cells += 1
        result = self.sandbox.run_python(code)
        # a cell that killed the interpreter may leave a fresh, empty one: the context must survive it
        if result.error and not self.sandbox.stopped and self.sandbox.run_python("_rlm_ready").error:
            self._seed()
        return result

    def _observation(self, result: Result) -> str:
        text = clip(result.output.rstrip("\n"), self.output_chars)
        error = f"[error: {clip(result.error, self.output_chars)}]" if result.error else ""
        return "\n<output>" + "\n".join(part for part in (text, error) if part) + "</output>\n"

    def _resolve(self, name: str) -> str | None:
        """FINAL_VAR's answer: the variable's text in the REPL (None when it is not a variable)."""
        if not name.isidentifier():
            return None
        result = self.sandbox.run_python(f"print({name})")
        return None if result.error else result.output.removesuffix("\n")


def guessed_final(task: Task) -> list[str]:
    """The flawed teacher's shortcut: FINAL(a guess) at once, without running the cell that computes it."""
    draw, family = guess_draw(task), task.info["family"]
    guess = guessed(lambda: one_guess(draw, family, task.answer), lambda g: normalize(g) != normalize(task.answer))
    return [f"FINAL({guess})"]


def one_guess(draw: random.Random, family: str, answer: str) -> str:
    """A guess of the answer's kind: a code, a place, or a number (a count, an amount, an id)."""
    if family == "needle":
        return "".join(draw.choice(CODE_CHARS) for _ in range(5))
    if family == "ask":
        return draw.choice(PLACES)
    return str(draw.randint(1, 2 * int(answer) + 2))


def outcome_metric(key: str) -> Callable[..., float]:
    """A reward function that reads the episode's grade (a FINAL_VAR answer is not in the transcript)."""
    def read(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
        if key not in outcome:
            raise ValueError(f"rlm is graded by its episode: score the outcome its finish() returned (no {key!r})")
        return outcome[key]
    return read


class RlmEnv(FlawedTeacher, CatalogueEnv):
    config_class = RlmEnvConfig
    action_stop = ("</repl>",)
    oracle_llm = staticmethod(oracle_llm)  # what the oracle's llm_query calls must answer for it to be right

    def __init__(self, config: RlmEnvConfig, name: str = "rlm"):
        super().__init__(config, name)
        correct, answered = outcome_metric("correct"), outcome_metric("answered")
        self.rubric = Rubric([RewardFunc("correct", correct, 1.0), RewardFunc("answered", answered, 0.0),
                              RewardFunc("llm_calls", outcome_metric("llm_calls"), 0.0),
                              RewardFunc("cells", outcome_metric("cells"), 0.0)], correct=correct, formatted=answered)

    @functools.cached_property
    def catalogue(self) -> list[Task]:
        return [self._task(index) for index in range(self.config.tasks)]

    def _task(self, index: int) -> Task:
        family, seed, chars = FAMILIES[index % len(FAMILIES)], f"{self.config.seed}:{index}", self.config.context_chars
        generated = generate(family, seed, chars)
        prompt = PROMPT.format(query=generated.query, kind=KINDS[generated.kind], chars=len(generated.context),
                               calls=self.config.max_llm_calls)
        return Task(id=f"{self.name}-{index}", prompt=prompt, answer=generated.answer,
                    info={"family": family, "seed": seed, "context_chars": chars, "code": generated.code,
                          "split": "eval" if index // len(FAMILIES) % EVAL_SHARE == 0 else "train"})

    def context(self, task: Task) -> str:
        return generate(task.info["family"], task.info["seed"], task.info["context_chars"]).context

    def start(self, task: Task, llm: SubPolicy | None = None) -> RlmEpisode:
        return RlmEpisode(task, self.context(task), self.config, llm)

    def oracle_actions(self, task: Task) -> list[str]:
        """Compute the answer into `n` in one cell (the `ask` family reads a note with llm_query), then FINAL_VAR(n)."""
        return [ORACLE_CELL.format(code=task.info["code"]), ORACLE_FINAL]

    def shortcut_actions(self, task: Task) -> list[str]:
        return guessed_final(task)
