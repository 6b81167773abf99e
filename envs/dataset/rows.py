"""Tasks from the rows of a prompts dataset (the `dataset` and `mcp` kinds): the rows of the env's
dataset stages (`data`, `eval_data`), handed over by the stage with `use_rows`, as tasks of each
split; the held-out split is `eval_fraction` of the rows (by a hash of the row's id and the env's
name, or the name of the env it is `held_out_as`) or a second dataset. A row's columns besides the
prompt ride along in `Task.info["columns"]`."""

from __future__ import annotations

import json
import math
import zlib

from data_contracts.formats import plain
from envs.base import Task, check_split
from envs.tools.schema import ToolSchemaError, tool_from_schema
from models.sampling import CONVERSATION_PREFIX, prompt_turns


class RowTasks:
    """The row-reading half of an env class (mixed in before its base)."""

    reads_data = True  # the stage gives it the rows of its dataset stages (use_rows)
    rows: dict[str, list[Task]] = {"train": [], "eval": []}  # replaced whole by use_rows, never mutated

    def learned_rewards(self) -> list:
        """The rewards a model gives, whose scorers the stage attaches (the dataset env's; none here)."""
        return []

    def data_stages(self) -> list[str]:
        return [stage for stage in (self.config.data, self.config.eval_data) if stage is not None]

    def use_rows(self, rows: list[dict], eval_rows: list[dict] | None = None) -> None:
        """The dataset's prompt rows as tasks of each split."""
        tasks = [self.task(row) for row in rows]
        if eval_rows is not None:
            self.rows = {"train": tasks, "eval": [self.task(row) for row in eval_rows]}
            return
        cut, key = self.config.eval_fraction, self.config.held_out_as or self.name
        held_out = [zlib.crc32(f"{key}-{row['id']}".encode()) % 10_000 < cut * 10_000 for row in rows]
        self.rows = {"train": [t for t, out in zip(tasks, held_out) if not out],
                     "eval": [t for t, out in zip(tasks, held_out) if out]}

    def task(self, row: dict) -> Task:
        prompt = row["prompt"]
        turns = prompt_turns(prompt) if prompt.startswith(CONVERSATION_PREFIX) else None
        extra = {key: _cell(value) for key, value in row.items()
                 if key not in ("id", "row", "prompt", "conversational", "tools", "malformed", "total_tokens")}
        answer = extra.get("answer")
        return Task(id=f"{self.name}-{row['id']}", prompt=prompt, answer="" if answer is None else str(answer),
                    info={"columns": extra, "prompt_turns": turns, **row_tools(row, self.name)})

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        check_split(split)
        pool = self.rows[split]
        if not pool:
            raise ValueError(f"env {self.name}: no {split} rows (is its dataset stage an input of this stage?)")
        order = list(pool)
        self.draw(split, seed).shuffle(order)
        return [order[i % len(order)] for i in range(n)]

    def all_tasks(self) -> list[Task]:
        return self.rows["train"] + self.rows["eval"]


def row_tools(row: dict, env: str) -> dict:
    """TRL's `tools` column of a row (OpenAI tool schemas, stored as JSON text): the tools its prompt
    is rendered with by the model's chat template (`{"tools": [...]}` of the task's info), if any."""
    cell = row.get("tools")
    if cell is None:
        return {}
    try:
        schemas = json.loads(cell) if isinstance(cell, str) else plain(cell)
        if not isinstance(schemas, list):
            raise ToolSchemaError(f"a JSON list of tool schemas expected, got {type(schemas).__name__}")
        return {"tools": [tool_from_schema(schema).openai() for schema in schemas]} if schemas else {}
    except (ValueError, ToolSchemaError) as exc:
        raise ValueError(f"env {env}: row {row['id']}: tools: {exc}") from None


def _cell(value):
    """A Parquet cell as a plain Python value (numpy scalars and arrays included; NaN is missing)."""
    value = plain(value)
    return None if isinstance(value, float) and math.isnan(value) else value
