"""`evaluate`: held-out metrics per checkpoint and env.

Per checkpoint and env: greedy accuracy and its standard error, format rate, doom-loop rate (greedy), mean
completion tokens (the policy's), mean turns, truncation rate, reward-function errors, and
sampled accuracy, and the mean of every graded outcome (a sandboxed env's tests, cod's reward
by position in the pack). Episodes are played through the env's protocol (tasks/rollout/episodes.py), so
multi-turn envs are evaluated the way they are trained. The
per-completion rows are the stage's evaluation-results dataset. Every checkpoint but the first (or
but the `baseline`) also gets `paired_gain` and `paired_se`: its greedy accuracy minus the previous
checkpoint's in the list (or the baseline's), on the same tasks, with the standard error of that
paired difference; with sampled episodes, `sampled_paired_gain` and `sampled_paired_se` likewise.
With `lm_eval` and `humaneval`, each checkpoint also gets lm-eval's tasks and HumanEval's pass@k beside its
envs (tasks/rollout/benchmarks.py), their rows in the same dataset.
"""

from __future__ import annotations

import math
import time
from typing import Literal

from pydantic import Field, model_validator

from data_contracts.config import ContractParams
from models.loading import load_tokenizer, set_threads
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.eval_report import unfinished_warnings, write_eval_report
from tasks.common.progress import Progress
from tasks.common.ranks import split_and_gather
from tasks.config import PLOT_MODULES, EvaluationSettings, StageBase
from tasks.rollout.backends import LocalRollout, Rollout
from tasks.rollout.benchmarks import benchmark_metrics
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import roll_out
from tasks.rollout.judge import judge_metrics, judge_rows
from tasks.rollout.scoring import prefetch_scores, score_episode


class EvaluateStage(StageBase, EvaluationSettings):
    """Held-out accuracy, format rate, doom-loop rate and length per checkpoint and env."""

    outputs = ("results", "report")
    primary = "results"
    produces = "evaluation"
    preload = ("peft", *PLOT_MODULES)

    kind: Literal["evaluate"]
    checkpoints: list[str] = Field(min_length=1)
    envs: list[str] = []  # none: the benchmarks alone (lm_eval, humaneval)
    baseline: str | None = None  # paired gains against this checkpoint; None: each against the one before it
    rollout: Rollout = Field(default_factory=LocalRollout)  # decode here, or on the server serving the one checkpoint

    @model_validator(mode="after")
    def _checkpoints(self):
        self.rollout.check_checkpoints(len(self.checkpoints))
        if not self.envs and self.lm_eval is None and self.humaneval is None:
            raise ValueError("envs: name at least one env, or a benchmark (lm_eval, humaneval)")
        if self.baseline is not None and self.baseline not in self.checkpoints:
            raise ValueError(f"baseline: {self.baseline!r} is not one of checkpoints ({', '.join(self.checkpoints)})")
        return self

    def params(self) -> dict:
        return self.rollout.keyed(super().params())

    def env_refs(self):
        return [(f"envs[{i}]", env) for i, env in enumerate(self.envs)]

    def read_sources(self, spec_dir, store) -> None:
        self.read_benchmark_sources(spec_dir, store)

    sources = EvaluationSettings.sources  # lm_eval.include_path's files (StageBase's would say none)

    def stage_refs(self):
        return [(f"checkpoints[{i}]", c, "checkpoint") for i, c in enumerate(self.checkpoints)]

    def endpoints(self) -> list[tuple[str, object]]:
        return self.rollout.endpoints() + ([("judge", self.judge)] if self.judge is not None else [])


def score_rows(env, trajectories, *, checkpoint: str, mode: str) -> list[dict]:
    rows = []
    prefetch_scores(trajectories, env)
    for trajectory in trajectories:
        task, episode = trajectory.task, score_episode(trajectory, env)
        rows.append({"checkpoint": checkpoint, "env": env.name, "mode": mode, "task_id": task.id,
                     "prompt": task.prompt, "answer": task.answer, "completion": trajectory.text,
                     "reward": episode.reward, "correct": episode.correct, "formatted": episode.formatted,
                     "doom_loop": episode.doom_loop, "finish_reason": "length" if trajectory.truncated else "stop",
                     "completion_tokens": trajectory.completion_tokens, "turns": len(trajectory.turns),
                     "reward_errors": len(episode.score.errors), "reward_not_applied": episode.score.not_applied,
                     **{f"outcome_{key}": float(value) for key, value in trajectory.outcome.items()}})
    return rows


def summarize(greedy: list[dict], sampled: list[dict]) -> dict:
    n = len(greedy)
    accuracy = sum(r["correct"] for r in greedy) / n
    metrics = {
        "accuracy": accuracy,
        "accuracy_se": math.sqrt(accuracy * (1 - accuracy) / n),
        "format_rate": sum(r["formatted"] for r in greedy) / n,
        "doom_loop_rate": sum(r["doom_loop"] for r in greedy) / n,
        "mean_completion_tokens": sum(r["completion_tokens"] for r in greedy) / n,
        "truncated_rate": sum(r["finish_reason"] == "length" for r in greedy) / n,
        "mean_turns": sum(r["turns"] for r in greedy) / n,
        "mean_reward": _mean_finite(r["reward"] for r in greedy),
        "reward_errors": sum(r["reward_errors"] for r in greedy + sampled),
        "n": n,
    }
    not_applied = sum(r["reward_not_applied"] for r in greedy + sampled)
    if not_applied:  # reward functions that said "does not apply" (None): counted, never scored 0
        metrics["reward_not_applied"] = not_applied
    if sampled:
        metrics["sampled_accuracy"] = sum(r["correct"] for r in sampled) / len(sampled)
    for key in sorted({key for row in greedy for key in row if key.startswith("outcome_")}):
        metrics[f"mean_{key}"] = _mean_finite(row[key] for row in greedy if key in row)  # e.g. cod's reward by position
    metrics.update(judge_metrics(greedy))  # empty unless a judge graded the rows
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}


def paired_difference(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean and standard error of d_i = after_i - before_i over the same n tasks:
    mean(d) and sd(d) / sqrt(n), sd with n - 1 (0 for one task). The pairing removes the
    spread between tasks that two independent rates' errors would both carry."""
    differences = [a - b for a, b in zip(after, before, strict=True)]
    n = len(differences)
    mean = sum(differences) / n
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(variance / n)


def add_paired_gains(metrics: dict[str, dict[str, dict]], rows: list[dict], baseline: str | None = None) -> None:
    """`paired_gain` / `paired_se` of each checkpoint over `baseline`, or else over the one before
    it in `metrics`, per env, from the greedy rows (every checkpoint plays the same eval tasks:
    paired by task id); `sampled_paired_gain` / `sampled_paired_se` from the sampled rows, if any."""
    checkpoints = list(metrics)
    pairs = ([(baseline, other) for other in checkpoints if other != baseline] if baseline is not None
             else list(zip(checkpoints, checkpoints[1:])))
    for mode, prefix in (("greedy", ""), ("sampled", "sampled_")):
        correct = {(r["checkpoint"], r["env"], r["task_id"]): float(r["correct"]) for r in rows if r["mode"] == mode}
        for before, after in pairs:
            for env_id, values in metrics[after].items():
                tasks = [task for (key, env, task) in correct if key == after and env == env_id]
                if not tasks:
                    continue
                gain, se = paired_difference([correct[before, env_id, t] for t in tasks],
                                             [correct[after, env_id, t] for t in tasks])
                values.update({f"{prefix}paired_gain": round(gain, 4), f"{prefix}paired_se": round(se, 4)})


def _mean_finite(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def evaluate_policy(policy, tokenizer, env, stage: EvaluateStage, label: str,
                    device: str = "cpu") -> tuple[list[dict], dict]:
    """Greedy (and, if asked, sampled) episodes of `policy` on `stage.n` eval tasks of `env`:
    the per-episode rows and their summary. The policy is a local model or an endpoint. Under
    several processes each plays its share of the tasks (task i samples with seed + i, whoever
    plays it) and all of them end up with every row (tasks/common/ranks.py)."""
    tasks = env.tasks("eval", stage.n, stage.seed)

    def play(mine: list[int]) -> list[list[dict]]:
        """[greedy row, sampled row (if asked)] of each task of this process's share."""
        own = [tasks[i] for i in mine]
        greedy = score_rows(env, roll_out(policy, tokenizer, env, own, SamplingParams(stage.max_new_tokens)),
                            checkpoint=label, mode="greedy")
        if stage.judge is not None:
            judge_rows(greedy, stage.judge)  # a failed request: that row's verdict NaN, counted
        sampled = [None] * len(own)
        if stage.sampled is not None:
            params = SamplingParams(stage.max_new_tokens, stage.sampled.temperature, stage.sampled.top_p)
            sampled = score_rows(env, roll_out(policy, tokenizer, env, own, params,
                                               episode_seeds=[stage.seed + i for i in mine]),
                                 checkpoint=label, mode="sampled")
        return [[g, s] for g, s in zip(greedy, sampled)]

    pairs = split_and_gather(len(tasks), play, device)
    greedy, sampled = [g for g, _ in pairs], [s for _, s in pairs if s is not None]
    return greedy + sampled, summarize(greedy, sampled)


def run(stage: EvaluateStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    rows, metrics = [], {}
    benchmarks = int(stage.lm_eval is not None) + int(stage.humaneval is not None)
    progress = Progress(len(stage.checkpoints) * (len(stage.envs) + benchmarks), 0, ctx.stage_id, log_every=1,
                        on_update=ctx.report_progress)  # a step: one checkpoint on one env (or benchmark)
    envs = {}  # built once (a reward model's scorer loads once), on the first checkpoint's tokenizer
    for checkpoint in stage.checkpoints:
        folder = ctx.fetch(checkpoint)
        tokenizer = load_tokenizer(folder, ctx.model)
        policy = stage.rollout.policy(folder, tokenizer, ctx, stage.batch_size)
        metrics[checkpoint] = {}
        for env_id in stage.envs:
            began = time.monotonic()
            if env_id not in envs:
                envs[env_id] = stage_env(ctx, env_id, tokenizer)
            env_rows, metrics[checkpoint][env_id] = evaluate_policy(policy, tokenizer, envs[env_id], stage,
                                                                    checkpoint, ctx.device)
            rows += env_rows
            ctx.log(f"{checkpoint} on {env_id}: {metrics[checkpoint][env_id]} "
                    f"({time.monotonic() - began:.1f}s)")
            progress.update(sum(len(done) for done in metrics.values()))
        if benchmarks:
            began = time.monotonic()
            benchmark_rows, scores = benchmark_metrics(stage, policy, folder, tokenizer, ctx, checkpoint)
            rows += benchmark_rows
            metrics[checkpoint].update(scores)
            ctx.log(f"{checkpoint} on {', '.join(scores)}: {scores} ({time.monotonic() - began:.1f}s)")
            progress.update(len(metrics) * (len(stage.envs) + benchmarks))
    add_paired_gains(metrics, rows, stage.baseline)
    warnings = unfinished_warnings(metrics, stage.max_new_tokens)
    for warning in warnings:
        ctx.log(f"warning: {warning}", "WARNING")
    out_dir = ctx.workdir / "results"
    write_rows(rows, out_dir)
    report_dir = ctx.workdir / "report"
    write_eval_report(metrics, {key: ctx.inputs[key] for key in stage.checkpoints}, report_dir,
                      f"evaluation {ctx.output_name}", warnings)
    return {"results": StageOutput("dataset", out_dir, metrics, ContractParams(kind="eval")),
            "report": StageOutput("report", report_dir)}
