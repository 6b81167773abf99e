"""`rl`: on-policy RL from verifiable rewards (GRPO family, StepPO), resumable like sft.

Each step: draw `prompts_per_step` train tasks from the env mix by weight, play `group_size`
episodes of each (tasks/rollout/episodes.py, single- or multi-turn), score them (tasks/stages/rl/
scoring.py: the env's rubric, the anti-doom repetition penalty, trace validation, overlong
shaping), drop the groups without signal when dynamic sampling is on (and draw more), turn rewards
into advantages and rows (batch.py) and take `num_iterations` clipped policy-gradient steps on them
(update.py, models/rl_losses.py); then publish the weights to the rollout server when due, if there is
one. With `asynchronous:` a producer thread samples ahead on the server instead (ahead.py).
The prompts of a step are a pure function of (seed, step, draw), so a resumed stage draws exactly
what it would have drawn.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

from models.loading import load_model, load_tokenizer, set_threads
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.ranks import split_and_gather
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import TASK_POOL, roll_out, step_tasks
from tasks.rollout.learned_rewards import judge_error_metrics
from tasks.rollout.scoring import prefetch_scores
from tasks.stages.rl.ahead import AheadRollouts, Batch, sync_metrics
from tasks.stages.rl.config import RlStage
from tasks.stages.rl.metrics import batch_metrics, sample_rows
from tasks.stages.rl.scoring import Scored, has_signal, score_trajectory, scored_data, scored_from_data
from tasks.stages.rl.update import PolicyUpdate
from tasks.train.loop import start_training
from tasks.train.sharding import full_weights

# Episode seeds: every draw of a step gets its own block of EPISODE_SEEDS_PER_DRAW seeds, so no two
# episodes of a stage share one (episode j of group i takes block + i * group_size + j).
EPISODE_SEEDS_PER_DRAW = 1_000_000
DRAWS_PER_STEP = 1024  # room for dynamic sampling's redraws within one step
STEPS_PER_SEED = 1_000_003  # more steps than a stage takes: two stage seeds never share a block


def draw_seed(stage_seed: int, step: int, draw: int) -> int:
    """The first episode seed of draw `draw` of step `step`."""
    return ((stage_seed * STEPS_PER_SEED + step) * DRAWS_PER_STEP + draw) * EPISODE_SEEDS_PER_DRAW


@dataclass
class EpisodeSampler:
    """What every step draws, plays and scores its episodes with: the stage, the tokenizer, its envs
    and their pools of train tasks, and the device (whose processes share the groups)."""

    stage: RlStage
    tokenizer: object
    envs: dict  # env id -> env
    pools: dict  # env id -> the train tasks steps draw from
    device: str = "cpu"

    def collect(self, policy, step: int) -> tuple[list[list[Scored]], list[Scored], int]:
        """The step's training groups, every episode it sampled, and how many draws it took."""
        stage = self.stage
        kept, sampled, draws = [], [], 0
        while True:
            picked = step_tasks(self.pools, stage.envs, stage.prompts_per_step, stage.seed, step, draws)
            groups = self.sample_groups(policy, picked, draw_seed(stage.seed, step, draws))
            sampled += [s for group in groups for s in group]
            draws += 1
            if stage.dynamic_sampling is None:
                return groups, sampled, draws
            kept += [group for group in groups if has_signal(group)]
            if len(kept) >= stage.prompts_per_step or draws >= stage.dynamic_sampling.max_rounds:
                return kept[:stage.prompts_per_step], sampled, draws

    def sample_groups(self, policy, picked: list[tuple[str, object]], seed: int) -> list[list[Scored]]:
        """`group_size` scored episodes of each picked (env id, task), one group per task, in picked
        order, played by `policy` (a LocalPolicy or a ServerPolicy).

        Episode j of group i samples with seed `seed + i * group_size + j`; under several processes
        each samples its share of the groups and all of them end up with every group
        (tasks/common/ranks.py)."""
        params = SamplingParams(self.stage.max_tokens, self.stage.temperature)
        size = self.stage.group_size

        def play(mine: list[int]) -> list[list[Scored]]:
            scored: dict[int, list[Scored]] = {}
            for env_id, env in self.envs.items():
                indices = [i for i in mine if picked[i][0] == env_id]
                if not indices:
                    continue
                tasks = [picked[i][1] for i in indices for _ in range(size)]
                trajectories = roll_out(policy, self.tokenizer, env, tasks, params,
                                        episode_seeds=[seed + i * size + j for i in indices for j in range(size)])
                prefetch_scores(trajectories, env)
                for k, i in enumerate(indices):
                    scored[i] = [score_trajectory(t, env, self.stage) for t in trajectories[k * size:(k + 1) * size]]
            return [scored[i] for i in mine]

        return split_and_gather(len(picked), play, self.device,
                                encode=lambda group: [scored_data(s) for s in group],
                                decode=lambda i, data: [scored_from_data(d, picked[i][1]) for d in data])


def sample_step(sampler: EpisodeSampler, policy, training, step: int, on_trained_weights: bool) -> Batch:
    """The step's batch, decoded now: on the trained model itself (`on_trained_weights`; a sharded
    model's whole weights gathered for it, a different number of decode steps on each process), or
    on a server in lockstep, which holds the weights of this very step (staleness 0)."""
    with full_weights(training.model) if on_trained_weights else nullcontext():
        groups, sampled, draws = sampler.collect(policy, step)
    training.accelerator.unwrap_model(training.model).train()  # the local engine decodes in eval mode
    return Batch(groups, sampled, draws, staleness=Counter(step - s.trajectory.policy_version for s in sampled))


def run(stage: RlStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source, ctx.model)
    envs = {env_id: stage_env(ctx, env_id, tokenizer) for env_id in stage.envs}
    for env_id, env in envs.items():
        if env.restarts_context and stage.algorithm != "steppo":  # a grpo row is one growing context
            raise ValueError(f"env {env_id!r} restarts contexts (cod); use algorithm: steppo")
    pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
    training = start_training(ctx, stage, source, stage.steps, tokenizer, updates_per_step=stage.num_iterations)
    reference = load_model(source, ctx.model).to(training.accelerator.device).eval() \
        if stage.beta and ctx.model.lora is None else None  # with LoRA: the policy with its adapters disabled
    sampler = EpisodeSampler(stage, tokenizer, envs, pools, str(training.accelerator.device))
    update = PolicyUpdate.of(stage, tokenizer.pad_token_id)
    model = training.accelerator.unwrap_model(training.model)
    policy = stage.rollout.trainer_policy(model, tokenizer, stage.prompts_per_step * stage.group_size)
    publisher = stage.rollout.publisher(policy, ctx.stage_id, ctx.model.lora is not None)
    ahead = None
    if stage.asynchronous is not None:
        if training.accelerator.num_processes > 1:
            raise ValueError("asynchronous: runs in one process (its rollouts overlap the update's collectives)")
        if publisher is None:
            raise ValueError(f"asynchronous: rollout backend {stage.rollout.backend!r} receives no weights to run "
                             "ahead with")
        ahead = AheadRollouts(sampler.collect, policy, model, publisher, publisher.every,
                              stage.asynchronous.max_staleness, stage.steps)
        ahead.start(training.start)
    elif publisher is not None:
        publisher.publish(model, training.start)  # the server decodes exactly the weights the stage starts from
    try:
        for step in range(training.start, stage.steps):
            began = time.perf_counter()
            if ahead is not None:
                batch = ahead.take(step)
            else:
                batch = sample_step(sampler, policy, training, step, not stage.rollout.samples_elsewhere)
            collected = time.perf_counter()
            metrics = batch_metrics(batch.sampled, list(stage.envs))
            metrics.update(judge_error_metrics(envs.values()))  # a judge reward's errors so far, by reason
            if batch.groups:  # empty when dynamic sampling found no group with signal within its draws
                metrics.update(update(training, reference, batch.groups)[0])
            updated = time.perf_counter()
            if ahead is not None:
                ahead.trained(step + 1)
            elif publisher is not None and (step + 1) % publisher.every == 0:
                publisher.publish(model, step + 1)
            record(training, stage, step, batch, metrics, (began, collected, updated), publisher is not None)
    finally:
        if ahead is not None:
            ahead.close()
        elif publisher is not None:
            publisher.retire()  # older versions a request still named when they were replaced
    history = training.history
    last = history[-10:]
    return training.finish({"algorithm": stage.algorithm,
                            "final_reward": sum(h["reward"] for h in last) / len(last),
                            "final_accuracy": sum(h["accuracy"] for h in last) / len(last),
                            "first_reward": history[0]["reward"],
                            "completion_tokens": sum(h["tokens"] for h in history)})


def record(training, stage: RlStage, step: int, batch: Batch, metrics: dict, times: tuple[float, float, float],
           publishes: bool) -> None:
    """The step's metrics: where its time went (sampling and scoring episodes, or waiting for them; the
    update; publishing the weights), dynamic sampling's draws, the weights' staleness; a samples table
    to the trackers every `samples_every` steps."""
    began, collected, updated = times
    metrics.update(rollout_seconds=collected - began, update_seconds=updated - collected)
    if stage.dynamic_sampling is not None:
        metrics.update(kept_groups=len(batch.groups), draws=batch.draws)
    if publishes:
        metrics.update(sync_metrics(batch, time.perf_counter() - updated))
    training.record(step, sum(s.trajectory.completion_tokens for s in batch.sampled), **metrics)
    if training.trackers.active and (step + 1) % stage.samples_every == 0:
        training.trackers.log_table(step + 1, sample_rows(batch.sampled))
