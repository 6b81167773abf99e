"""`rl`: on-policy RL from verifiable rewards (GRPO family, StepPO), resumable like sft.

Each step: draw `prompts_per_step` train tasks from the env mix by weight, play `group_size`
episodes of each (tasks/common/rollouts.py, single- or multi-turn), score them (tasks/stages/rl/
scoring.py: the env's rubric, the anti-doom repetition penalty, trace validation, overlong
shaping), drop the groups without signal when dynamic sampling is on (and draw more), turn rewards
into advantages and rows (batch.py) and take `num_iterations` clipped policy-gradient steps on them
(update.py, models/rl_losses.py); then publish the weights to the rollout server, if there is one.
The prompts of a step are a pure function of (seed, step, draw), so a resumed stage draws exactly
what it would have drawn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from models.loading import load_model, load_tokenizer, set_threads
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.ranks import split_and_gather
from tasks.common.rollouts import TASK_POOL, roll_out, step_tasks
from tasks.common.scoring import prefetch_scores
from tasks.common.training import start_training
from tasks.stages.rl.config import RlStage
from tasks.stages.rl.metrics import batch_metrics, sample_rows
from tasks.stages.rl.scoring import Scored, has_signal, score_trajectory, scored_data, scored_from_data
from tasks.stages.rl.update import train_step


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
    metrics.update(rollouts.sync_metrics(batch, time.perf_counter() - updated))
    training.record(step, completion_tokens, **metrics)
    if training.trackers.active and (step + 1) % stage.samples_every == 0:
        training.trackers.log_table(step + 1, sample_rows(sampled))


def run(stage: RlStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source, ctx.model)
    envs = {env_id: ctx.env(env_id, tokenizer) for env_id in stage.envs}
    for env_id, env in envs.items():
        if env.restarts_context and stage.algorithm != "steppo":  # a grpo row is one growing context
            raise ValueError(f"env {env_id!r} restarts contexts (cod); use algorithm: steppo")
    pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
    training = start_training(ctx, stage, source, stage.steps, tokenizer, updates_per_step=stage.num_iterations)
    reference = load_model(source, ctx.model).to(training.accelerator.device).eval() \
        if stage.beta and ctx.model.lora is None else None  # with LoRA: the policy with its adapters disabled
    sampler = EpisodeSampler(stage, tokenizer, envs, pools, str(training.accelerator.device))
    rollouts = stage.rollout.source(stage, sampler.collect, training, tokenizer, ctx)
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
