"""`generate`: on-policy rollouts from a checkpoint, scored by the env's rubric.

A multi-turn env's completions are whole episodes (tasks/rollout/episodes.py), whose rows carry a loss
mask so that preference training scores the policy's tokens only.

Per prompt, `samples` sampled completions and `greedy` greedy ones (the group the preference
and RL stages compare within). Each row keeps its tokens and per-token log-probs, the
reward of every rubric function, the total reward and the doom-loop flag. The dataset goes
through the rollouts contract (group size, reward range, truncated share, context length).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from data_contracts.config import ContractParams
from envs.tools.chat import task_tools
from models.loading import context_length, load_tokenizer, resolve_base, set_threads
from models.sampling import SamplingParams, chat_prompt
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.progress import Progress
from tasks.common.ranks import split_and_gather
from tasks.config import ONE_SEQUENCE_ONLY, SpecView, StageBase
from tasks.rollout.backends import LocalRollout, Rollout
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import Trajectory, roll_out, single_turn
from tasks.rollout.learned_rewards import judge_error_metrics
from tasks.rollout.scoring import prefetch_scores, score_episode


class GenerateStage(StageBase):
    """On-policy rollouts: `samples` sampled + `greedy` greedy completions per prompt, scored by the env."""

    outputs = ("rollouts",)
    primary = "rollouts"
    produces = "rollouts"
    preload = ("peft",)

    kind: Literal["generate"]
    policy: str
    env: str
    n: int = Field(gt=0)  # prompts
    split: Literal["train", "eval"] = "train"
    samples: int = Field(5, ge=0)
    greedy: int = Field(1, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, gt=0)
    batch_size: int = Field(64, gt=0)
    seed: int = 0
    rollout: Rollout = Field(default_factory=LocalRollout)  # decode here, or on an inference server

    @model_validator(mode="after")
    def _some_completions(self):
        if self.samples + self.greedy < 1:
            raise ValueError("samples + greedy must be at least 1")
        return self

    def params(self) -> dict:
        return self.rollout.keyed(super().params())

    def env_refs(self):
        return [("env", self.env)]

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]

    def endpoints(self) -> list[tuple[str, object]]:
        return self.rollout.endpoints()

    def check_spec(self, spec: SpecView) -> None:
        env = spec.envs[self.env]
        if spec.env_class(self.env).restarts_context:  # a class flag: nothing to build
            raise spec.error(self.id, "env", f"env {self.env!r} ({env.kind}) {ONE_SEQUENCE_ONLY}")

    def check_pairable(self, spec: SpecView, preference_id: str) -> None:
        if self.samples < 1:
            raise spec.error(self.id, "samples", f"must be at least 1, generate stage {self.id!r} feeds "
                                                 f"preference stage {preference_id!r}, which pairs sampled completions")
        if self.samples + self.greedy < 2:
            raise spec.error(self.id, None, f"samples + greedy must be at least 2, generate stage {self.id!r} "
                                            f"feeds preference stage {preference_id!r}, which pairs two completions "
                                            "per prompt")


def sample_seeds(stage: GenerateStage, indices: list[int]) -> list[int]:
    """The seed of each sampled completion of the prompts `indices`: sample j of prompt i has
    `seed + i * samples + j`, whichever process makes it."""
    return [stage.seed + i * stage.samples + j for i in indices for j in range(stage.samples)]


def completions(policy, prompt_ids: list[list[int]], stage: GenerateStage,
                report=lambda done: None, indices: list[int] | None = None) -> list[list]:
    """For each prompt (`indices`: their places among the stage's prompts, default 0, 1, …): its
    sampled completions, then its greedy ones, from `policy` (a LocalPolicy or a ServerPolicy);
    `report(done)` as batches end."""
    indices = indices if indices is not None else list(range(len(prompt_ids)))
    sampled = policy.generate_many([p for p in prompt_ids for _ in range(stage.samples)],
                                   SamplingParams(stage.max_tokens, stage.temperature, stage.top_p),
                                   sample_seeds(stage, indices), report) if stage.samples else []
    greedy = policy.generate_many(prompt_ids, SamplingParams(stage.max_tokens), list(range(len(prompt_ids))),
                                  lambda done: report(len(sampled) + done)) if stage.greedy else []
    return [sampled[i * stage.samples:(i + 1) * stage.samples] + ([greedy[i]] * stage.greedy if greedy else [])
            for i in range(len(prompt_ids))]


def single_turn_groups(env, tasks, prompt_ids, groups) -> list[list[Trajectory]]:
    """Each task's completions (`completions`) as the one-action episodes they are."""
    return [[single_turn(env.name, task, prompt, generation) for generation in group]
            for task, prompt, group in zip(tasks, prompt_ids, groups)]


def episode_groups(env, tasks, policy, tokenizer, stage: GenerateStage, report=lambda done: None,
                   indices: list[int] | None = None) -> list[list[Trajectory]]:
    """Each task's episodes (sampled ones, then greedy ones) played through the env (tool calls,
    observations); `report(done)` as episodes end. `indices`: the tasks' places among the stage's
    (default 0, 1, …)."""
    indices = indices if indices is not None else list(range(len(tasks)))
    sampled = roll_out(policy, tokenizer, env, [t for t in tasks for _ in range(stage.samples)],
                       SamplingParams(stage.max_tokens, stage.temperature, stage.top_p),
                       episode_seeds=sample_seeds(stage, indices), on_finished=report)
    greedy = roll_out(policy, tokenizer, env, tasks, SamplingParams(stage.max_tokens),
                      on_finished=lambda done: report(len(sampled) + done)) if stage.greedy else []
    return [sampled[i * stage.samples:(i + 1) * stage.samples] + ([greedy[i]] * stage.greedy if greedy else [])
            for i in range(len(tasks))]


def rollout_rows(env, groups: list[list[Trajectory]], stage: GenerateStage) -> list[dict]:
    """The dataset rows of each task's group: its episodes scored (`score_episode`), sampled ones
    first. A multi-turn env's rows also carry the loss mask (1 on the policy's tokens), the env mask
    and the number of turns; `logprobs` are the sampler's, 0 on the env's tokens."""
    multi_turn = env.max_turns > 1
    rows = []
    prefetch_scores([trajectory for group in groups for trajectory in group], env)
    for group in groups:
        for index, trajectory in enumerate(group):
            task, episode = trajectory.task, score_episode(trajectory, env)
            ids, mask = trajectory.completion()
            row = {"id": f"{task.id}-{index}", "prompt_id": task.id, "group_index": index,
                   "mode": "sampled" if index < stage.samples else "greedy", "prompt": task.prompt,
                   "answer": task.answer, "completion": trajectory.text, "tokens": ids,
                   "logprobs": trajectory.behaviour_logps() or []}
            if multi_turn:
                row.update(loss_mask=mask, env_mask=[1 - m for m in mask])
            row.update(finish_reason="length" if trajectory.truncated else "stop",
                       total_tokens=len(trajectory.prompt_ids) + len(ids))
            if multi_turn:
                row["turns"] = len(trajectory.turns)
            rows.append({**row, "reward": episode.reward, **episode.reward_columns(),
                         "reward_errors": len(episode.score.errors), "correct": episode.correct,
                         "doom_loop": episode.doom_loop})
    return rows


def run(stage: GenerateStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    folder = ctx.fetch(stage.policy)
    tokenizer = load_tokenizer(folder, ctx.model)
    policy = stage.rollout.policy(folder, tokenizer, ctx, stage.batch_size)
    env = stage_env(ctx, stage.env, tokenizer)
    tasks = env.tasks(stage.split, stage.n, stage.seed)
    per_task = stage.samples + stage.greedy

    def rows_of(mine: list[int]) -> list[list[dict]]:
        """The rows of this process's share of the tasks, grouped by task."""
        progress = Progress(len(mine) * per_task, 0, ctx.stage_id, log_every=1,
                            on_update=ctx.report_progress)  # a step: one completion (a batch at a time)
        own = [tasks[i] for i in mine]
        if env.max_turns > 1:
            groups = episode_groups(env, own, policy, tokenizer, stage, progress.update, mine)
        else:
            prompt_ids = [chat_prompt(tokenizer, task.prompt, task_tools(task)) for task in own]
            groups = single_turn_groups(env, own, prompt_ids,
                                        completions(policy, prompt_ids, stage, progress.update, mine))
        rows = rollout_rows(env, groups, stage)
        return [rows[k * per_task:(k + 1) * per_task] for k in range(len(mine))]

    rows = [row for task_rows in split_and_gather(len(tasks), rows_of, ctx.device) for row in task_rows]
    out_dir = ctx.workdir / "rollouts"
    write_rows(rows, out_dir)
    greedy = [r for r in rows if r["mode"] == "greedy"]
    metrics = {"rows": len(rows), "prompts": len(tasks),
               "truncated_rate": round(sum(r["finish_reason"] == "length" for r in rows) / len(rows), 4)}
    if greedy:
        metrics.update(greedy_accuracy=round(sum(r["correct"] for r in greedy) / len(greedy), 4),
                       greedy_doom_loop_rate=round(sum(r["doom_loop"] for r in greedy) / len(greedy), 4))
    metrics.update(judge_error_metrics([env]))  # a judge reward's errors by reason (this process's share)
    ctx.log(f"{len(rows)} rollouts over {len(tasks)} prompts: {metrics}")
    contract = ContractParams(kind="rollouts", group_size=stage.samples + stage.greedy,
                              reward_range=env.rubric.reward_range, context_length=context_length(resolve_base(ctx.model.base)))
    return {"rollouts": StageOutput("dataset", out_dir, metrics, contract)}
