"""`rl`: on-policy RL from verifiable rewards (GRPO family, StepPO), resumable like sft.

Each step: draw `prompts_per_step` train tasks from the env mix by weight, play `group_size`
episodes of each (tasks/common/rollouts.py, single- or multi-turn), score them (the env's rubric,
the anti-doom repetition penalty, trace validation, overlong shaping), drop the groups without
signal when dynamic sampling is on (and draw more), turn rewards into advantages and rows
(tasks/common/rl_batch.py) and take `num_iterations` clipped policy-gradient steps on them
(models/rl_losses.py). The prompts of a step are a pure function of (seed, step, draw), so a
resumed stage draws exactly what it would have drawn.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envs.base import RewardFunc, Rubric
from envs.doom import DoomLoopDetector, overlong_excess, repetition_excess, trace_is_valid
from models.loading import load_model, load_tokenizer, set_threads
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.rl_metrics import batch_metrics, sample_rows
from tasks.common.rl_update import train_step
from tasks.common.ranks import split_and_gather
from tasks.common.rl_rollouts import rollouts_of
from tasks.common.rollouts import LocalPolicy, Trajectory, TurnRecord, roll_out
from tasks.common.server_policy import ServerPolicy
from tasks.common.weight_sync import WeightSync
from tasks.common.training import start_training
from tasks.config import (
    ONE_SEQUENCE_ONLY,
    PLOT_MODULES,
    AntiDoom,
    DynamicSampling,
    Overlong,
    Rollout,
    SpecView,
    TrainStage,
)


class Asynchronous(BaseModel):
    """Rollouts for the next steps decode while the trainer trains: at most `max_staleness` policy
    versions behind the weights a step trains (older rows are dropped and counted)."""

    model_config = ConfigDict(extra="forbid")

    max_staleness: int = Field(1, ge=1)


class RlStage(TrainStage):
    """On-policy RL from verifiable rewards over a weighted mix of environments.

    `grpo`: one training row per trajectory (env-written tokens masked), token-level ratio.
    `steppo`: one row per turn (the action), critic-free step advantages from group-normalized
    rewards-to-go, one sequence-level ratio per step (DOMAIN.md, StepPO). With `credit: cod`,
    Connect the Dots packs get mean-style returns against the same slot of the pack's other
    rollouts (DOMAIN.md, CoD), by default without std scaling (`scale_rewards` left unset).
    """

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints

    kind: Literal["rl"]
    policy: str
    envs: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # env id -> mixing weight
    algorithm: Literal["grpo", "steppo"] = "grpo"
    loss_aggregation: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    steps: int = Field(gt=0)
    prompts_per_step: int = Field(8, gt=0)
    group_size: int = Field(8, ge=2)
    epsilon_low: float = Field(0.2, ge=0, lt=1)  # clip range (binds once a batch is reused)
    epsilon_high: float = Field(0.28, ge=0)
    beta: float = Field(0.0, ge=0)  # k3 KL to the input checkpoint (with LoRA: the adapter-disabled base)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1)  # updates per batch; the ratio's old policy is the sampling one
    gamma: float = Field(1.0, gt=0, le=1)  # steppo: discount of the reward-to-go
    credit: Literal["reward_to_go", "cod"] = "reward_to_go"  # steppo: how step rewards become returns
    dynamic_sampling: DynamicSampling | None = None
    overlong: Overlong | None = None
    mask_truncated: bool = False  # actions cut by max_tokens add no gradient (grpo: their whole trajectory)
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(64, gt=0)
    anti_doom: AntiDoom | None = None
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(5, ge=0)
    checkpoint_every: int = Field(50, gt=0)
    samples_every: int = Field(10, gt=0)  # a table of the step's episodes to the trackers of report_to
    rollout: Rollout = Field(default_factory=Rollout)
    asynchronous: Asynchronous | None = None
    importance_cap: float = Field(2.0, gt=0)  # C of the truncated importance weights (server-sampled rows)

    @model_validator(mode="after")
    def _clip_range(self):
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(f"epsilon_high ({self.epsilon_high}) must be at least epsilon_low ({self.epsilon_low})")
        if self.overlong is not None and self.overlong.buffer >= self.max_tokens:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be below max_tokens ({self.max_tokens})")
        if self.credit == "cod" and self.algorithm != "steppo":
            raise ValueError("credit: cod assigns credit per step; use algorithm: steppo")
        if self.rollout.backend == "server" and self.rollout.sync_folder is None:
            raise ValueError("rollout.sync_folder: an rl stage on a server publishes its weights there (a folder the "
                             "server reads: serve-model's --lora-folder)")
        if self.asynchronous is not None and self.rollout.backend != "server":
            raise ValueError("asynchronous: needs rollout.backend server (rollouts decode there while this trains)")
        if self.asynchronous is not None and self.asynchronous.max_staleness < self.rollout.sync_every - 1:
            raise ValueError(f"asynchronous.max_staleness ({self.asynchronous.max_staleness}) must be at least "
                             f"rollout.sync_every - 1 ({self.rollout.sync_every - 1}): rollouts wait for weights "
                             "that recent")
        if self.credit == "cod" and "scale_rewards" not in self.model_fields_set:
            self.scale_rewards = "none"  # CoD's baseline is the slot's mean over the group, no std unless asked
        return self

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs]

    def params(self) -> dict:
        """Without reporting (`samples_every`) and where the rollout server is (its URL, key, folder);
        a local stage's key leaves out the server's fields altogether (keys made before they existed hold)."""
        params = {key: value for key, value in super().params().items() if key != "samples_every"}
        return self.rollout.keyed(params, ("asynchronous", "importance_cap"))

    def stage_refs(self):
        return [("policy", self.policy, "checkpoint")]

    def endpoints(self) -> list[tuple[str, object]]:
        return [("rollout", self.rollout)] if self.rollout.backend == "server" else []

    def check_spec(self, spec: SpecView) -> None:
        """A grpo row is one growing context: an env that restarts it (cod) needs steppo's rows per step."""
        super().check_spec(spec)
        if self.algorithm != "grpo":
            return
        for env_id in self.envs:
            if spec.env_class(env_id).restarts_context:
                raise spec.error(self.id, f"envs.{env_id}", f"env {env_id!r} ({spec.envs[env_id].kind}) "
                                                            f"{ONE_SEQUENCE_ONLY}")


TASK_POOL = 4096  # train tasks drawn per env; steps sample from it


@dataclass
class Scored:
    trajectory: Trajectory
    step_rewards: list[float]  # per turn; the last holds the rubric's shaped score (NaN if a reward raised)
    correct: bool
    doom_loop: bool
    repetition: float  # the anti-doom term before its weight (0 without anti_doom)
    overlong: float  # the overlong term before its weight (0 without overlong)
    valid_trace: bool
    rewards: dict = field(default_factory=dict)  # each reward function's value (the rubric's and the stage's)

    @property
    def reward(self) -> float:
        return sum(self.step_rewards)


def anti_doom_rubric(stage: RlStage) -> Rubric:
    """The stage's own terms, scored on the policy's actions only (never on what the env wrote:
    search passages or terminal logs repeat by nature): the anti-doom repetition penalty."""
    if stage.anti_doom is None:
        return Rubric([])
    doom = stage.anti_doom

    def repetition(actions, task, outcome):
        return repetition_excess(actions, doom.ngram, doom.threshold)

    return Rubric([RewardFunc("repetition", repetition, -doom.penalty)])


def score_trajectory(trajectory: Trajectory, env, rubric: Rubric, stage: RlStage,
                     detector: DoomLoopDetector) -> Scored:
    """Step rewards of an episode: the env's per-step rewards, and on the last step the env
    rubric's score of the transcript plus the stage's shaping of the actions."""
    text, task, actions = trajectory.text, trajectory.task, "".join(trajectory.actions)
    score = rubric.score(text, task, trajectory.outcome, trajectory.completion()[0])
    shaped = anti_doom_rubric(stage).score(actions, task, trajectory.outcome)
    shaping = shaped.total
    valid = trace_is_valid(actions, trajectory.truncated)
    total = score.total
    if not valid and stage.anti_doom is not None and stage.anti_doom.validate_trace and math.isfinite(total):
        total = rubric.penalties(score)  # a reward function that raised stays NaN: never a silent value
    overlong = 0.0
    if stage.overlong is not None:
        overlong = max(overlong_excess(len(turn.action_ids), stage.max_tokens, stage.overlong.buffer)
                       for turn in trajectory.turns)
        shaping -= stage.overlong.penalty * overlong
    step_rewards = [turn.reward for turn in trajectory.turns]
    # an env that pays per step (cod: every solve turn; its rubric restates them as the pack's mean), and a cut
    # pack keeps what its solved tasks earned: only the stage's shaping is added there
    step_rewards[-1] += shaping + (0.0 if env.pays_per_step else total)
    repetition = repetition_excess(actions, stage.anti_doom.ngram, stage.anti_doom.threshold) \
        if stage.anti_doom is not None else 0.0
    return Scored(trajectory, step_rewards, env.is_correct(text, task, trajectory.outcome),
                  detector.is_loop(actions, trajectory.truncated), repetition, overlong, valid,
                  {**score.rewards, **shaped.rewards})


def step_tasks(pools: dict[str, list], weights: dict[str, float], count: int, seed: int, step: int, draw: int = 0):
    """(env id, task) pairs of a step: envs drawn by weight, tasks drawn from the env's pool."""
    rng = random.Random(f"rl:{seed}:{step}" + (f":{draw}" if draw else ""))
    env_ids = rng.choices(list(weights), weights=list(weights.values()), k=count)
    return [(env_id, pools[env_id][rng.randrange(len(pools[env_id]))]) for env_id in env_ids]


def sample_groups(policy, tokenizer, envs: dict, rubric_of: dict, picked, stage: RlStage, seed: int,
                  detector: DoomLoopDetector, device: str = "cpu") -> list[list[Scored]]:
    """`group_size` scored episodes of each picked task, one group per task, in picked order, played
    by `policy` (the local engine's LocalPolicy, or a ServerPolicy).

    Episode j of group i samples with seed `seed + i * group_size + j`; under several processes
    each samples its share of the groups and all of them end up with every group
    (tasks/common/ranks.py)."""
    params = SamplingParams(stage.max_tokens, stage.temperature)
    size = stage.group_size

    def play(mine: list[int]) -> list[list[Scored]]:
        scored: dict[int, list[Scored]] = {}
        for env_id, env in envs.items():
            indices = [i for i in mine if picked[i][0] == env_id]
            if not indices:
                continue
            tasks = [picked[i][1] for i in indices for _ in range(size)]
            trajectories = roll_out(policy, tokenizer, env, tasks, params,
                                    episode_seeds=[seed + i * size + j for i in indices for j in range(size)])
            for k, i in enumerate(indices):
                group = trajectories[k * size:(k + 1) * size]
                scored[i] = [score_trajectory(t, env, rubric_of[env_id], stage, detector) for t in group]
        return [scored[i] for i in mine]

    return split_and_gather(len(picked), play, device, encode=lambda group: [scored_data(s) for s in group],
                            decode=lambda i, data: [scored_from_data(d, picked[i][1]) for d in data])


def scored_data(scored: Scored) -> dict:
    """A scored episode as JSON values, without its task (every process drew the same tasks)."""
    data = asdict(scored)
    del data["trajectory"]["task"]
    return data


def scored_from_data(data: dict, task) -> Scored:
    trajectory = dict(data["trajectory"], task=task, turns=[TurnRecord(**turn) for turn in data["trajectory"]["turns"]])
    return Scored(**dict(data, trajectory=Trajectory(**trajectory)))


def has_signal(group: list[Scored]) -> bool:
    rewards = [s.reward for s in group if math.isfinite(s.reward)]
    return len(rewards) >= 2 and max(rewards) - min(rewards) > 1e-9


def collect(policy, tokenizer, envs, rubric_of, pools, stage: RlStage, step: int, detector, device: str = "cpu"):
    """The step's training groups, every episode it sampled, and how many draws it took."""
    kept, sampled, draws = [], [], 0
    while True:
        picked = step_tasks(pools, stage.envs, stage.prompts_per_step, stage.seed, step, draws)
        # a million episode seeds per draw: no two episodes of the stage share one
        groups = sample_groups(policy, tokenizer, envs, rubric_of, picked, stage,
                               ((stage.seed * 1_000_003 + step) * 1024 + draws) * 1_000_000, detector, device)
        sampled += [s for group in groups for s in group]
        draws += 1
        if stage.dynamic_sampling is None:
            return groups, sampled, draws
        kept += [group for group in groups if has_signal(group)]
        if len(kept) >= stage.prompts_per_step or draws >= stage.dynamic_sampling.max_rounds:
            return kept[:stage.prompts_per_step], sampled, draws


def train_on(rollouts, step: int, training, reference, stage: RlStage, tokenizer) -> None:
    """One step: the step's rollouts, the update on them, the metrics; then the new weights go out."""
    began = time.perf_counter()
    batch = rollouts.take(step)
    groups, sampled = batch.groups, batch.sampled
    metrics = batch_metrics(sampled, list(stage.envs))
    completion_tokens = sum(s.trajectory.completion_tokens for s in sampled)
    collected = time.perf_counter()
    if groups:  # empty when dynamic sampling found no group with signal within its draws
        update, _ = train_step(training, reference, groups, stage, tokenizer.pad_token_id)
        metrics.update(update)
    updated = time.perf_counter()
    rollouts.trained(step + 1)  # publishes the new weights to a server when due
    # where a step's time goes: sampling and scoring episodes (or waiting for them), the policy update,
    # publishing the weights
    metrics.update(rollout_seconds=collected - began, update_seconds=updated - collected)
    if stage.dynamic_sampling is not None:
        metrics.update(kept_groups=len(groups), draws=batch.draws)
    if stage.rollout.backend == "server":
        episodes = max(1, sum(batch.staleness.values()))
        metrics.update(sync_seconds=time.perf_counter() - updated, stale_groups=batch.stale_groups,
                       staleness=sum(k * n for k, n in batch.staleness.items()) / episodes,
                       **{f"staleness_{k}": n for k, n in sorted(batch.staleness.items())})
    training.record(step, completion_tokens, **metrics)
    if training.trackers.active and (step + 1) % stage.samples_every == 0:
        training.trackers.log_table(step + 1, sample_rows(sampled))


def rollout_source(stage: RlStage, ctx: StageContext, policy, tokenizer, training, collect_with):
    """The stage's Rollouts: its own engine, or the server of `rollout:` with the weight sync to it."""
    local = LocalPolicy(policy, tokenizer, stage.prompts_per_step * stage.group_size)
    if stage.rollout.backend == "local":
        return rollouts_of(stage, collect_with, local, policy)
    if stage.asynchronous is not None and training.accelerator.num_processes > 1:
        raise ValueError("asynchronous: runs in one process (its rollouts overlap the update's collectives)")
    server = ServerPolicy.checked(stage.rollout, tokenizer, policy.config.vocab_size)  # before any training
    sync = WeightSync(server, stage.rollout.sync_folder, ctx.stage_id, ctx.model.lora is not None)
    return rollouts_of(stage, collect_with, local, policy, server, sync)


def run(stage: RlStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source)
    envs = {env_id: ctx.env(env_id) for env_id in stage.envs}
    for env_id, env in envs.items():
        if env.restarts_context and stage.algorithm != "steppo":  # a grpo row is one growing context
            raise ValueError(f"env {env_id!r} restarts contexts (cod); use algorithm: steppo")
    rubric_of = {env_id: env.rubric for env_id, env in envs.items()}
    pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
    training = start_training(ctx, stage, source, stage.steps, tokenizer, updates_per_step=stage.num_iterations)
    policy = training.accelerator.unwrap_model(training.model)
    lora = ctx.model.lora is not None
    reference = load_model(source, ctx.model).to(training.accelerator.device).eval() if stage.beta and not lora \
        else None
    detector = DoomLoopDetector()
    device = str(training.accelerator.device)
    rollouts = rollout_source(stage, ctx, policy, tokenizer, training, lambda rollout_policy, step: collect(
        rollout_policy, tokenizer, envs, rubric_of, pools, stage, step, detector, device))
    rollouts.start(training.start)
    try:
        for step in range(training.start, stage.steps):
            train_on(rollouts, step, training, reference, stage, tokenizer)
    finally:
        rollouts.close()
    history = training.history
    last = history[-10:]
    return training.finish({"algorithm": stage.algorithm,
                            "final_reward": sum(h["reward"] for h in last) / len(last),
                            "final_accuracy": sum(h["accuracy"] for h in last) / len(last),
                            "first_reward": history[0]["reward"],
                            "completion_tokens": sum(h["tokens"] for h in history)})
