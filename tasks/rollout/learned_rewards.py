"""Learned rewards: the scorers behind a dataset env's `{reward_model: STAGE}` and `{judge: ...}`
rewards (envs/dataset/), attached by the stage that plays the env (tasks/rollout/envs.py).

Each keeps a cache of its scores by (prompt, completion) for the stage's run, so a completion
sampled twice (a group's identical answers, greedy repeats) is scored once, and scores many at
once when the stage prefetches a batch (`Rubric.prefetch`): a reward model in batches through its
forward, a judge in concurrent requests (through the one judge client, tasks/rollout/judge_client.py:
the completion fenced, the score read from the reply's final `SCORE:` line only). A score that
cannot be had (a judge request past its deadline, a reply with no final score line) raises when the
rubric asks for it: the rubric records the error and the episode's reward is NaN, counted
(`reward_errors`; a judge's errors by reason in `judge_errors_<reason>`), never a silent 0.
"""

from __future__ import annotations

import math
from collections import Counter

from envs.dataset import DatasetEnv, JudgeReward, JudgeScoring, RewardModelReward
from models.loading import load_model, load_tokenizer
from tasks.common.errors import ConfigMismatch
from tasks.rollout.endpoint_policy import EndpointError
from tasks.rollout.judge_client import (
    JudgeClient,
    JudgeError,
    JudgeFailure,
    JudgeReplyError,
    JudgeRequestError,
    ScoreForm,
    error_metrics,
)
from tasks.rollout.reward_models import check_same_tokenizer, reward_examples, scores_in_batches


class JudgeConfigError(ConfigMismatch):
    """A judge that cannot score as configured (it answered no score to the probe); one line, and
    retrying the stage cannot fix it."""


class RewardModelScorer:
    """A `reward_model` stage's model scoring (prompt, completion) pairs."""

    def __init__(self, reward: RewardModelReward, folder, model_cfg, device: str):
        self.reward = reward
        self.tokenizer = load_tokenizer(folder, model_cfg)
        self.model = load_model(folder, model_cfg, reward_head=True).to(device).eval()
        self.device = device
        self.cache: dict[tuple[str, str], float] = {}

    def prefetch(self, items: list[tuple[str, str, str]]) -> None:
        missing = list(dict.fromkeys((prompt, completion) for prompt, completion, _ in items
                                     if (prompt, completion) not in self.cache))
        if not missing:
            return
        examples = reward_examples(self.tokenizer, missing, self.reward.max_length)
        scores = scores_in_batches(self.model, examples, self.tokenizer.pad_token_id, self.device,
                                   self.reward.batch_size)
        for key, score in zip(missing, scores):
            self.cache[key] = 1 / (1 + math.exp(-score)) if self.reward.output == "sigmoid" else score

    def score(self, prompt: str, completion: str, answer: str) -> float:
        if (prompt, completion) not in self.cache:
            self.prefetch([(prompt, completion, answer)])
        return self.cache[(prompt, completion)]


class JudgeScorer:
    """A judge model at an OpenAI-compatible endpoint answering a score per completion: its reply's
    final line `SCORE: <number>`, from min_score to max_score, as a reward in [0, 1]."""

    def __init__(self, judge: JudgeScoring, field: str):
        self.judge, self.field = judge, field
        self.client = JudgeClient.of(judge, ScoreForm(judge.min_score, judge.max_score), judge.prompt, field)
        self.cache: dict[tuple[str, str, str], float | JudgeError] = {}  # a score, or why there is none

    def check(self, prompt: str, completion: str, answer: str) -> None:
        """One request before any training: the endpoint answers, and answers a score."""
        try:
            value = self.client.judge(prompt, completion, answer)
        except JudgeRequestError as exc:  # perhaps passing: the stage's retries may find it up
            raise EndpointError(f"{self.field}: {exc}") from None
        except JudgeReplyError as exc:  # it answers, but no score: asking again gets the same
            raise JudgeConfigError(f"{self.field}: the judge {self.judge.describe()} answered no score ({exc}); "
                                   f"its reply must end with the line SCORE: N, N from {self.judge.min_score:g} "
                                   f"to {self.judge.max_score:g}") from None
        self.cache[(prompt, completion, answer)] = value

    def prefetch(self, items: list[tuple[str, str, str]]) -> None:
        missing = list(dict.fromkeys(item for item in items if item not in self.cache))
        for item, value in zip(missing, self.client.judge_all(missing)):
            self.cache[item] = value

    def score(self, prompt: str, completion: str, answer: str) -> float:
        key = (prompt, completion, answer)
        if key not in self.cache:
            self.prefetch([key])
        value = self.cache[key]
        if isinstance(value, JudgeError):
            raise value  # the rubric records it: NaN, counted
        return value

    def error_counts(self) -> Counter[JudgeFailure]:
        return self.client.errors.counts()


def judge_error_metrics(envs) -> dict[str, int]:
    """`judge_errors` and `judge_errors_<reason>` of the judge rewards of these envs, counted by this
    process so far in the stage; empty where no env has a judge reward."""
    judges = [scorer for env in envs if isinstance(env, DatasetEnv)
              for scorer in env.scorers.values() if isinstance(scorer, JudgeScorer)]
    return error_metrics(sum((judge.error_counts() for judge in judges), Counter())) if judges else {}


def attach_scorers(env, env_id: str, fetch, model_cfg, device: str, policy_tokenizer=None) -> None:
    """Give a dataset env the scorers of its learned rewards: each reward model loaded from the
    store (`fetch(stage id)`), its tokenizer checked against the policy's; each judge checked with
    one request on a train task's reference answer."""
    scorers = {}
    for i, reward in enumerate(env.config.rewards):
        field = f"envs.{env_id}.rewards[{i}]"
        if isinstance(reward, RewardModelReward):
            scorer = RewardModelScorer(reward, fetch(reward.reward_model), model_cfg, device)
            if policy_tokenizer is not None:
                check_same_tokenizer(scorer.tokenizer, policy_tokenizer, f"{field}.reward_model")
            scorers[reward.label] = scorer
        elif isinstance(reward, JudgeReward):
            scorer = JudgeScorer(reward.judge, f"{field}.judge")
            task = env.tasks("train", 1, 0)[0]
            scorer.check(task.prompt, env.reference_completion(task), task.answer)
            scorers[reward.label] = scorer
    env.use_scorers(scorers)
