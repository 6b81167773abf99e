"""Learned rewards: the scorers behind a dataset env's `{reward_model: STAGE}` and `{judge: ...}`
rewards (envs/dataset/), attached by the stage that plays the env (tasks/rollout/envs.py).

Each keeps a cache of its scores by (prompt, completion) for the stage's run, so a completion
sampled twice (a group's identical answers, greedy repeats) is scored once, and scores many at
once when the stage prefetches a batch (`Rubric.prefetch`): a reward model in batches through its
forward, a judge in concurrent requests. A score that cannot be had (a judge that timed out after
its retries, or answered no number) raises when the rubric asks for it: the rubric records the
error and the episode's reward is NaN, counted (`reward_errors`), never a silent 0.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor

from envs.dataset import JudgeReward, JudgeScoring, RewardModelReward
from models.loading import load_model, load_tokenizer
from models.sampling import SamplingParams
from tasks.common.errors import ConfigMismatch
from tasks.rollout.endpoint_policy import EndpointError, EndpointPolicy, endpoint_api_key
from tasks.rollout.reward_models import check_same_tokenizer, reward_examples, scores_in_batches

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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
    first number, from min_score to max_score, as a reward in [0, 1]."""

    def __init__(self, judge: JudgeScoring, field: str):
        self.judge, self.field = judge, field
        self.policy = EndpointPolicy(judge.endpoint, judge.model, None, api_key=endpoint_api_key(judge, field),
                                     max_retries=judge.retries, timeout=judge.timeout_seconds)
        self.cache: dict[tuple[str, str, str], float | str] = {}  # a score, or why there is none

    def check(self, prompt: str, completion: str, answer: str) -> None:
        """One request before any training: the endpoint answers, and answers a score."""
        try:
            value = self._ask((prompt, completion, answer))
        except EndpointError as exc:  # perhaps passing: the stage's retries may find it up
            raise EndpointError(f"{self.field}: {exc}") from None
        if isinstance(value, str):
            raise JudgeConfigError(f"{self.field}: the judge {self.judge.describe()} {value}; its prompt must ask "
                                   f"for a number from {self.judge.min_score:g} to {self.judge.max_score:g}")
        self.cache[(prompt, completion, answer)] = value

    def prefetch(self, items: list[tuple[str, str, str]]) -> None:
        missing = list(dict.fromkeys(item for item in items if item not in self.cache))
        with ThreadPoolExecutor(max_workers=self.judge.max_workers) as pool:
            for item, value in zip(missing, pool.map(self._answer, missing)):
                self.cache[item] = value

    def score(self, prompt: str, completion: str, answer: str) -> float:
        key = (prompt, completion, answer)
        if key not in self.cache:
            self.prefetch([key])
        value = self.cache[key]
        if isinstance(value, str):
            raise ValueError(f"judge {self.judge.describe()} {value}")
        return value

    def _answer(self, item: tuple[str, str, str]) -> float | str:
        try:
            return self._ask(item)
        except EndpointError as exc:
            return f"failed: {exc}"

    def _ask(self, item: tuple[str, str, str]) -> float | str:
        prompt, completion, answer = item
        text = self.judge.prompt.format(prompt=prompt, completion=completion, answer=answer)
        return judge_reward(self.policy.complete(text, SamplingParams(self.judge.max_tokens)), self.judge)


def judge_reward(reply: str, judge: JudgeScoring) -> float | str:
    """The reward in a judge's reply: its first number scaled from [min_score, max_score] to [0, 1]
    (clamped), or why there is none."""
    found = _NUMBER.search(reply)
    if found is None:
        return f"answered no score: {reply.strip()[:80]!r}"
    value = (float(found.group(0)) - judge.min_score) / (judge.max_score - judge.min_score)
    return min(1.0, max(0.0, value))


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
