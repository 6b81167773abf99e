"""`synthesize`: teacher traces for SFT from an environment's train split.

The teacher is the env's programmatic oracle, or a model behind an OpenAI-compatible endpoint
(`teacher: {endpoint, model}`: `posttrain serve-model`, vLLM, an API model) that plays the env
through the same episode loop as any policy (tasks/rollout/endpoint_policy.py). Each row carries its
token length under the spec's model, so the sft contract can hold it to the model's context.

A multi-turn env's teacher is played through the real episode loop (tasks/rollout/episodes.py, the
sandbox included), and its rows carry the exact token ids with a loss mask: SFT trains on the
policy's actions, never on what the env wrote, and on the very ids RL will see.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from data_contracts.config import ContractParams
from envs.base import Task, teacher_actions
from models.loading import context_length, load_tokenizer, resolve_base
from models.sampling import SamplingParams, chat_prompt
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.progress import Progress
from tasks.config import EndpointTeacher, StageBase
from tasks.rollout.env_check import CHUNK, scripted_rollouts
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import Trajectory, roll_out


class SynthesizeStage(StageBase):
    """Teacher traces for SFT from an environment's train split."""

    outputs = ("dataset",)
    primary = "dataset"
    produces = "dataset"
    uses_accelerator = False  # an oracle or an endpoint plays the tasks (a reward model's env: set gpus)

    kind: Literal["synthesize"]
    env: str
    n: int = Field(gt=0)
    teacher: Literal["oracle"] | EndpointTeacher = "oracle"  # the env's programmatic oracle, or a model
    seed: int = 0
    # leave out the first `skip` tasks of the seed's order: stages that share a seed and split one
    # draw between them (`skip: 0, n: 3000` and `skip: 3000, n: 3000`) play distinct tasks side by side
    skip: int = Field(0, ge=0)

    @field_validator("teacher", mode="before")
    @classmethod
    def _oracle_or_endpoint(cls, value):
        """A mapping is an endpoint teacher: its own errors name its fields (`teacher.model: missing`)
        instead of listing why it is not 'oracle' either."""
        if isinstance(value, dict):
            return EndpointTeacher.model_validate(value)
        if value != "oracle" and not isinstance(value, EndpointTeacher):
            raise PydanticCustomError("teacher", "expected 'oracle' or an endpoint teacher (a mapping with "
                                                 "endpoint and model)")
        return value

    def env_refs(self):
        return [("env", self.env)]

    def endpoints(self) -> list[tuple[str, object]]:
        return [("teacher", self.teacher)] if isinstance(self.teacher, EndpointTeacher) else []


Teacher = str | EndpointTeacher  # "oracle", or a model at an endpoint


def teacher_policy(teacher: EndpointTeacher, tokenizer):
    """The endpoint as a rollout policy; its key comes from the environment variable the spec names."""
    from tasks.rollout.endpoint_policy import EndpointPolicy

    return EndpointPolicy.of(teacher, tokenizer, "teacher")


def _no_report(done: int) -> None:
    pass


def endpoint_rollouts(env, tokenizer, tasks: list[Task], teacher: EndpointTeacher, seed: int = 0,
                      report=_no_report) -> list[Trajectory]:
    """The endpoint teacher's episodes, CHUNK at a time (a sandboxed env holds one sandbox each);
    `report(done)` as episodes end."""
    policy = teacher_policy(teacher, tokenizer)
    params = SamplingParams(teacher.max_tokens, teacher.temperature or None)
    trajectories = []
    for start in range(0, len(tasks), CHUNK):
        trajectories += roll_out(policy, tokenizer, env, tasks[start:start + CHUNK], params, seed=seed + start,
                                 on_finished=lambda done, before=start: report(before + done))
    return trajectories


def teacher_trajectories(env, tokenizer, tasks: list[Task], teacher: Teacher, seed: int = 0,
                         report=_no_report) -> list[Trajectory]:
    """The teacher's episodes of `tasks`: the oracle's scripted actions, or the endpoint's."""
    if teacher == "oracle":
        return scripted_rollouts(env, tokenizer, tasks, [teacher_actions(env, task) for task in tasks], report)
    if isinstance(teacher, EndpointTeacher):
        return endpoint_rollouts(env, tokenizer, tasks, teacher, seed, report)
    raise ValueError(f"unknown teacher {teacher!r}")


def teacher_completions(env, tasks: list[Task], teacher: Teacher, tokenizer=None, seed: int = 0,
                        report=_no_report) -> list[str]:
    """A single-turn env's completions: the oracle's reference, or the endpoint's answers."""
    if teacher == "oracle":
        completions = [env.reference_completion(task) for task in tasks]
        report(len(tasks))
        return completions
    return [trajectory.text for trajectory in teacher_trajectories(env, tokenizer, tasks, teacher, seed, report)]


def total_tokens(tokenizer, prompt: str, completion: str) -> int:
    """Length of the chat-formatted example as SFT will train on it (prompt + completion + end token)."""
    return len(chat_prompt(tokenizer, prompt)) + len(tokenizer(completion, add_special_tokens=False)["input_ids"]) + 1


def segments(trajectory: Trajectory) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each stretch of turns that share one growing context; an env
    that restarts the context (CoD's next episode of a pack) starts a new stretch."""
    stretches: list[tuple[list[int], list[int]]] = []
    for turn in trajectory.turns:
        if not stretches or stretches[-1][0] != turn.context_ids:
            stretches.append((list(turn.context_ids), [0] * len(turn.context_ids)))
        ids, mask = stretches[-1]
        ids += turn.action_ids + turn.observation_ids
        mask += [1] * len(turn.action_ids) + [0] * len(turn.observation_ids)
    return stretches


def trajectory_rows(env, env_id: str, trajectories: list[Trajectory], tokenizer) -> tuple[list[dict], int]:
    """Rows of a teacher's episodes (one per context stretch) and how many episodes it solved."""
    rows, solved = [], 0
    for trajectory in trajectories:
        solved += env.is_correct(trajectory.text, trajectory.task, trajectory.outcome)
        for k, (ids, mask) in enumerate(segments(trajectory)):
            rows.append({"id": f"{trajectory.task.id}-{k}", "env": env_id, "prompt": trajectory.task.prompt,
                         "completion": tokenizer.decode(ids[mask.index(1):], skip_special_tokens=True),
                         "answer": trajectory.task.answer, "token_ids": ids, "loss_mask": mask,
                         "total_tokens": len(ids)})
    return rows, solved


def multi_turn_rows(env, env_id: str, tasks: list[Task], tokenizer, teacher: Teacher = "oracle",
                    seed: int = 0, report=_no_report) -> tuple[list[dict], int]:
    """Rows of the teacher's episodes of `tasks` (the oracle's unless told otherwise)."""
    return trajectory_rows(env, env_id, teacher_trajectories(env, tokenizer, tasks, teacher, seed, report), tokenizer)


def single_turn_rows(env, env_id: str, tasks: list[Task], teacher: Teacher, tokenizer,
                     seed: int = 0, report=_no_report) -> tuple[list[dict], int]:
    completions = teacher_completions(env, tasks, teacher, tokenizer, seed, report)
    rows = [{"id": task.id, "env": env_id, "prompt": task.prompt, "completion": completion,
             "answer": task.answer, "total_tokens": total_tokens(tokenizer, task.prompt, completion)}
            for task, completion in zip(tasks, completions)]
    return rows, sum(env.is_correct(c, t) for c, t in zip(completions, tasks))


def longest_action(rows: list[dict]) -> int:
    """Tokens of the longest action the rows train (a run of the loss mask: the end token included):
    the least max_tokens / max_new_tokens a later rl or evaluate stage may give one action, else the
    actions SFT taught are cut before their end and the env never runs them."""
    longest = 0
    for row in rows:
        run = 0
        for trained in row["loss_mask"]:
            run = run + 1 if trained else 0
            longest = max(longest, run)
    return longest


def teacher_name(teacher: Teacher) -> str:
    return teacher.describe() if isinstance(teacher, EndpointTeacher) else teacher


def drawn_tasks(env, stage: SynthesizeStage) -> list[Task]:
    """The stage's `n` train tasks: the seed's order from task `skip` on. An env with fewer tasks
    than that (a dataset's rows) gives some again: each repeat gets its own id (`<id>-r<k>`), as a
    dataset's ids must be unique."""
    return unique_ids(env.tasks("train", stage.skip + stage.n, stage.seed)[stage.skip:])


def unique_ids(tasks: list[Task]) -> list[Task]:
    seen: dict[str, int] = {}
    unique = []
    for task in tasks:
        repeat = seen.get(task.id, 0)
        seen[task.id] = repeat + 1
        unique.append(replace(task, id=f"{task.id}-r{repeat}") if repeat else task)
    return unique


def run(stage: SynthesizeStage, ctx: StageContext) -> dict[str, StageOutput]:
    base = resolve_base(ctx.model.base)
    tokenizer = load_tokenizer(base, ctx.model)
    env = stage_env(ctx, stage.env, tokenizer)  # a tool env writes its oracle's calls in the tokenizer's format
    tasks = drawn_tasks(env, stage)
    progress = Progress(len(tasks), 0, ctx.stage_id, log_every=CHUNK,
                        on_update=ctx.report_progress)  # a step: one teacher episode
    metrics = {}
    if env.max_turns > 1:
        rows, solved = multi_turn_rows(env, stage.env, tasks, tokenizer, stage.teacher, stage.seed, progress.update)
        metrics["longest_action_tokens"] = longest_action(rows)
    else:
        rows, solved = single_turn_rows(env, stage.env, tasks, stage.teacher, tokenizer, stage.seed, progress.update)
    out_dir = ctx.workdir / "dataset"
    write_rows(rows, out_dir)
    ctx.log(f"{len(rows)} examples from {len(tasks)} {stage.env} tasks ({teacher_name(stage.teacher)} teacher)")
    if metrics:
        ctx.log(f"the longest action is {metrics['longest_action_tokens']} tokens, its end token included: an rl "
                f"stage's max_tokens or an evaluate stage's max_new_tokens below it cuts the actions SFT learns here")
    contract = ContractParams(kind="sft", context_length=context_length(base))
    return {"dataset": StageOutput("dataset", out_dir, {"rows": len(rows), "teacher_accuracy": solved / len(tasks),
                                                        **metrics}, contract)}
