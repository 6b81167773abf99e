"""`search` (Search-R1): question answering over a local corpus with a search tool.

The policy may think (`<think>…</think>`), calls the tool with `<search>query</search>` (the action
ends at `</search>`) and gets the top-k passages by bm25 from a SQLite FTS5 index, as
`<information>title: text</information>` (env-written, masked from the loss); an action with
`<answer>…</answer>` and no search, or with neither, ends the episode. Reward: normalized exact
match of the single answer. The corpus is a seeded synthetic world (envs/search/corpus.py), some
questions need two searches ("where was the founder of X born?").
"""

from __future__ import annotations

import os
import re
import sqlite3
import string
import threading
import zlib
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.base import NO_OUTCOME, EnvBase, Outcome, RewardFunc, Rubric, SubPolicy, Task, Turn, check_split
from envs.search.corpus import Corpus, Passage, corpus
from envs.shortcuts import FlawedTeacher

PROMPT = ("Answer the question. Look facts up with <search>query</search>, then reply <answer>...</answer>.\n"
          "Question: {question}")
SEARCH = "<search>{query}</search>"
ANSWER = "<answer>{answer}</answer>"
INFORMATION = "\n<information>{passages}</information>\n"
NO_RESULTS = "no results"
MAX_QUERY_TERMS = 12  # longer queries are cut: a query is a few keywords, not the whole transcript
EVAL_SHARE = 10  # one question in EVAL_SHARE goes to the held-out split
_SEARCH = re.compile(r"<search>(.*?)</search>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_OBSERVATION = re.compile(r"\n<information>(.*?)</information>\n", re.S)
_TERM = re.compile(r"[a-z0-9]+")
_THINK = r"\s*(?:<think>[^<]*</think>\s*)?"
_CALL_ACTION = re.compile(_THINK + r"<search>[^<]*\S[^<]*</search>\s*")
_FINAL_ACTION = re.compile(_THINK + r"<answer>[^<]*\S[^<]*</answer>\s*")
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class SearchEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["search"]
    passages: int = Field(2000, ge=2000, le=20000)  # corpus size (the world is scaled to at least this many)
    top_k: int = Field(2, ge=1, le=5)  # passages per search (keep prompt + transcript short for the tiny model)
    max_turns: int = Field(4, ge=2, le=8)
    seed: int = Field(0, ge=0)  # the synthetic world's seed
    format_weight: float = Field(0.0, ge=0)  # 0: the format check is a logged metric only
    # the share of tasks whose synthesize-stage oracle teacher answers from the first hit (envs/shortcuts.py)
    teacher_shortcut_rate: float = Field(0.0, ge=0, le=1)


class Fts5Unavailable(RuntimeError):
    pass


class SearchIndex:
    """A bm25 full-text index of the passages (SQLite FTS5, in memory)."""

    def __init__(self, passages: tuple[Passage, ...]):
        self.passages = passages
        self._lock = threading.Lock()  # one connection, shared by the threads of a process
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        require_fts5(self._db)
        self._db.execute("CREATE VIRTUAL TABLE passages USING fts5(title, body)")
        self._db.executemany("INSERT INTO passages(rowid, title, body) VALUES (?, ?, ?)",
                             [(i, p.title, p.text) for i, p in enumerate(passages)])

    def search(self, query: str, k: int) -> list[int]:
        """Indices of the k best passages for a free-text query (any word matches; bm25 ranks)."""
        terms = _TERM.findall(query.lower())[:MAX_QUERY_TERMS]
        if not terms:
            return []
        match = " OR ".join(f'"{term}"' for term in dict.fromkeys(terms))  # quoted: never FTS5 syntax
        with self._lock:
            rows = self._db.execute("SELECT rowid FROM passages WHERE passages MATCH ? "
                                    "ORDER BY bm25(passages), rowid LIMIT ?", (match, k)).fetchall()
        return [row[0] for row in rows]


def require_fts5(db: sqlite3.Connection) -> None:
    try:
        db.execute("CREATE VIRTUAL TABLE temp.fts5_probe USING fts5(x)")
        db.execute("DROP TABLE temp.fts5_probe")
    except sqlite3.OperationalError as exc:
        raise Fts5Unavailable(f"the search env needs SQLite's FTS5 full-text extension, which this Python's sqlite3 "
                              f"(SQLite {sqlite3.sqlite_version}) lacks: {exc}") from exc


_INDEXES: dict[tuple[int, int, int], SearchIndex] = {}
_INDEXES_LOCK = threading.Lock()


def search_index(passages: int, seed: int) -> SearchIndex:
    """The index of a world, built once per process (a forked child builds its own connection)."""
    key = (passages, seed, os.getpid())
    with _INDEXES_LOCK:
        if key not in _INDEXES:
            _INDEXES[key] = SearchIndex(corpus(passages, seed).passages)
        return _INDEXES[key]


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's EM)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _actions(transcript: str) -> list[str]:
    """The policy's actions: the transcript split at the env's observations."""
    return _OBSERVATION.split(transcript)[::2]


def exact_match(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """1 when the transcript holds exactly one answer and it matches (answer spam does not pay)."""
    answers = _ANSWER.findall(transcript)
    return float(len(answers) == 1 and normalize_answer(answers[0]) == normalize_answer(task.answer))


def format_ok(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """Every action before the last is one search; the last is exactly one answer."""
    *calls, final = _actions(transcript)
    return float(all(_CALL_ACTION.fullmatch(call) for call in calls) and bool(_FINAL_ACTION.fullmatch(final)))


def searches(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    return float(sum(len(_SEARCH.findall(action)) for action in _actions(transcript)))


def gold_retrieved(transcript: str, task: Task, outcome: Outcome = NO_OUTCOME) -> float:
    """1 when every passage the question needs was shown to the policy."""
    shown = {line for block in _OBSERVATION.findall(transcript) for line in block.split("\n")}
    return float(all(passage in shown for passage in task.info["gold"]))


class SearchEpisode:
    def __init__(self, index: SearchIndex, top_k: int):
        self.index, self.top_k = index, top_k

    def step(self, action: str) -> Turn:
        call = _SEARCH.search(action)
        if call is None:  # an answer, or no call at all: the episode is over
            return Turn(done=True)
        found = [str(self.index.passages[i]) for i in self.index.search(call.group(1), self.top_k)]
        return Turn(observation=INFORMATION.format(passages="\n".join(found) or NO_RESULTS))

    def finish(self) -> Outcome:
        return NO_OUTCOME


class SearchEnv(FlawedTeacher, EnvBase):
    config_class = SearchEnvConfig
    action_stop = ("</search>",)

    def __init__(self, config: SearchEnvConfig, name: str = "search"):
        super().__init__(config, name)
        self.rubric = Rubric.paid_checks(exact_match, format_ok, config.format_weight,
                                         RewardFunc("searches", searches, 0.0),
                                         RewardFunc("gold_retrieved", gold_retrieved, 0.0))
        self._pool: list[Task] | None = None

    @property
    def index(self) -> SearchIndex:
        return search_index(self.config.passages, self.config.seed)

    def _task_pool(self) -> list[Task]:
        """Every question whose oracle queries find their gold passages in the top k (built once)."""
        if self._pool is None:
            world: Corpus = corpus(self.config.passages, self.config.seed)
            index = self.index
            self._pool = [
                Task(id=f"{self.name}-{i}", prompt=PROMPT.format(question=q.question), answer=q.answer,
                     info={"queries": list(q.queries), "gold": [str(world.passages[g]) for g in q.gold],
                           "relation": q.relation, "hops": len(q.queries)})
                for i, q in enumerate(world.questions)
                if all(g in index.search(query, self.config.top_k) for query, g in zip(q.queries, q.gold))]
        return self._pool

    def split_tasks(self, split: str) -> list[Task]:
        check_split(split)
        held_out = split == "eval"
        return [t for t in self._task_pool() if (zlib.crc32(t.prompt.encode()) % EVAL_SHARE == 0) == held_out]

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks of a split in seeded order, cycling when the split is smaller (repeats get a new id)."""
        pool = self.split_tasks(split)
        self.draw(split, seed).shuffle(pool)
        if n and not pool:
            raise ValueError(f"{self.name}: no {split} task passes its retrieval check (top_k={self.config.top_k})")
        tasks = []
        for i in range(n):
            task = pool[i % len(pool)]
            tasks.append(task if i < len(pool) else replace(task, id=f"{task.id}-r{i // len(pool)}"))
        return tasks

    def all_tasks(self) -> list[Task]:
        return self.split_tasks("train") + self.split_tasks("eval")

    def start(self, task: Task, llm: SubPolicy | None = None) -> SearchEpisode:
        return SearchEpisode(self.index, self.config.top_k)

    def oracle_actions(self, task: Task) -> list[str]:
        """The reference searches (one per hop), then the answer."""
        return [SEARCH.format(query=query) for query in task.info["queries"]] + [ANSWER.format(answer=task.answer)]

    def shortcut_actions(self, task: Task) -> list[str] | None:
        """The teacher's shortcut: one search, then an answer read off its first hit without following
        it up: a two-hop question's bridge (the first hop's answer, whom the second search would ask
        about), a one-hop question's first hit's title (the passage's subject, not the fact it states)."""
        first = task.info["queries"][0]
        if task.info["hops"] > 1:
            answer = task.info["queries"][1].rsplit(" ", 1)[0]  # every second query is "<bridge> <relation word>"
        else:
            answer = self.index.passages[self.index.search(first, self.config.top_k)[0]].title
        if normalize_answer(answer) == normalize_answer(task.answer):
            return None
        return [SEARCH.format(query=first), ANSWER.format(answer=answer)]
