"""How a judge endpoint is asked: the settings of the one judge client (tasks/rollout/judge_client.py),
shared by the evaluation judge (tasks/config.py: `Judge`) and a dataset env's judge reward
(envs/dataset/config.py: `JudgeScoring`). It lives here, in the lowest layer both configs read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class JudgeRequests(BaseModel):
    """One request's deadline (wall clock, across every read and retry: a server trickling bytes
    cannot stretch it), its retries within that deadline, the requests in flight at once, and the
    largest reply body read (a bigger one is an error, not read on)."""

    model_config = ConfigDict(extra="forbid")

    timeout_seconds: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0)  # a request that cannot connect, or gets 408, 409, 429 or 5xx, is sent again
    max_workers: int = Field(4, gt=0)
    max_reply_bytes: int = Field(64 * 1024, gt=0)
