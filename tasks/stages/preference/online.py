"""Online DPO (`mode: online`, TRL's OnlineDPOTrainer as a stage).

Every step draws `batch_size` train prompts from the stage's envs by weight, samples two whole
episodes of each from the model being trained (a multi-turn env's own tokens masked), scores them
with the env's rubric (a reward model or a judge where the env has one, else its verifier) and
takes one step of the DPO-family loss on the pairs whose rewards differ, the higher chosen,
against the input checkpoint as the reference (under LoRA the same model with its adapters
disabled, so no second copy is kept). TRL keeps a tied pair with its first completion chosen; a
tie states no preference, so it is dropped here and counted, as the offline stage drops it. The
pairs trained on are committed as `<stage>.pairs`, like the offline stage's.
"""

from __future__ import annotations

import contextlib
import math

from models.loading import load_model
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import write_rows
from tasks.common.encoding import Example, encode_ids
from tasks.common.errors import NoTrainingData
from tasks.common.pairs import PairStats
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import TASK_POOL, LocalPolicy, roll_out, step_tasks
from tasks.rollout.learned_rewards import judge_error_metrics
from tasks.rollout.scoring import prefetch_scores, score_episode
from tasks.stages.preference.config import PreferenceStage
from tasks.stages.preference.step import pairs_contract, reference_logps, train_step
from tasks.train.loop import start_training

SAMPLES = 2  # completions per prompt, as TRL's online DPO
SEEDS_PER_STEP = 1_000_003  # episode seeds of a step: a block of their own


def episode_pairs(trajectories: list, scores: list, stats: PairStats) -> list[tuple]:
    """(chosen, rejected, chosen reward, rejected reward) of each prompt's two episodes (laid out
    prompt by prompt) whose rewards are finite and differ; the others counted in `stats`."""
    pairs = []
    for i in range(0, len(trajectories), SAMPLES):
        (first, a), (second, b) = zip(trajectories[i:i + SAMPLES], scores[i:i + SAMPLES])
        stats.prompts += 1
        if not (math.isfinite(a) and math.isfinite(b)):
            stats.dropped_unscored += 1
        elif abs(a - b) <= 1e-9:
            stats.dropped_tied += 1
        else:
            pairs.append((first, second, a, b) if a > b else (second, first, b, a))
    stats.pairs += len(pairs)
    return pairs


def side(trajectory, max_len: int) -> Example:
    """One side of a pair as the loss reads it: its prompt masked, the policy's tokens scored (an
    env's tokens of a multi-turn episode masked too)."""
    ids, mask = trajectory.completion()
    return encode_ids(trajectory.prompt_ids, ids, max_len, mask if len(trajectory.turns) > 1 else None)


def pair_row(step: int, index: int, chosen, rejected, chosen_reward: float, rejected_reward: float,
             ref_chosen: float, ref_rejected: float, examples: list[Example]) -> dict:
    """A pair trained on, with the columns of the offline stage's pairs."""
    return {"id": f"step-{step}-{index}-{chosen.task.id}", "prompt": chosen.task.prompt, "chosen": chosen.text,
            "rejected": rejected.text, "chosen_score": chosen_reward, "rejected_score": rejected_reward,
            "chosen_tokens": [int(t) for t in chosen.completion()[0]],
            "rejected_tokens": [int(t) for t in rejected.completion()[0]], "chosen_mode": "sampled",
            "rejected_mode": "sampled", "rejected_doom_loop": False, "step": step,
            "ref_chosen_logp": ref_chosen, "ref_rejected_logp": ref_rejected,
            "total_tokens": max(len(examples[0].input_ids), len(examples[1].input_ids))}


class Sampler:
    """What every step plays and scores: the envs, their pools of train tasks, the policy."""

    def __init__(self, stage: PreferenceStage, envs: dict, policy, tokenizer):
        self.stage, self.envs, self.policy, self.tokenizer = stage, envs, policy, tokenizer
        self.pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
        self.params = SamplingParams(stage.max_tokens, stage.temperature)

    def pairs(self, step: int, stats: PairStats) -> tuple[list[tuple], list[float]]:
        """The step's pairs and every sampled episode's reward."""
        picked = step_tasks(self.pools, self.stage.envs, self.stage.batch_size, self.stage.seed, step,
                            stream="online-dpo")
        first_seed = (self.stage.seed * SEEDS_PER_STEP + step) * SAMPLES * self.stage.batch_size
        pairs, rewards = [], []
        for env_id, env in self.envs.items():
            indices = [i for i, (picked_env, _) in enumerate(picked) if picked_env == env_id]
            if not indices:
                continue
            tasks = [picked[i][1] for i in indices for _ in range(SAMPLES)]
            seeds = [first_seed + SAMPLES * i + j for i in indices for j in range(SAMPLES)]
            trajectories = roll_out(self.policy, self.tokenizer, env, tasks, self.params, episode_seeds=seeds)
            prefetch_scores(trajectories, env)
            scores = [score_episode(trajectory, env).reward for trajectory in trajectories]
            pairs += episode_pairs(trajectories, scores, stats)
            rewards += [score for score in scores if math.isfinite(score)]
        return pairs, rewards


def reference_of(model, reference, examples: list[Example], pad_id: int, device) -> list[float]:
    """The reference's summed log-probs of `examples`: a separate model, or (LoRA) the trained one
    with its adapters off; the trained model left in training mode."""
    adapters_off = model.disable_adapter() if reference is None else contextlib.nullcontext()
    with adapters_off:
        values = reference_logps(model if reference is None else reference, examples, pad_id, device)
    model.train()
    return values


def run_online(stage: PreferenceStage, ctx: StageContext, source: str, tokenizer) -> dict[str, StageOutput]:
    import torch

    envs = {env_id: stage_env(ctx, env_id, tokenizer) for env_id in stage.envs}
    training = start_training(ctx, stage, source, stage.max_steps, tokenizer)
    if training.accelerator.num_processes > 1:
        raise ValueError("mode: online runs in one process (its sampling and its update share one model)")
    device, pad_id = training.accelerator.device, tokenizer.pad_token_id
    model = training.accelerator.unwrap_model(training.model)
    reference = load_model(source, ctx.model).to(device).eval() if ctx.model.lora is None else None
    sampler = Sampler(stage, envs, LocalPolicy(model, tokenizer, SAMPLES * stage.batch_size), tokenizer)
    stats, rows = PairStats(), []
    for step in range(training.start, training.steps):
        model.eval()
        with torch.no_grad():
            pairs, rewards = sampler.pairs(step, stats)
        model.train()
        sampled = {"sampled_reward": sum(rewards) / len(rewards) if rewards else math.nan, "pairs": len(pairs),
                   **judge_error_metrics(envs.values())}  # a judge reward's errors so far, by reason
        if not pairs:  # every prompt's two completions tied: nothing to prefer this step
            training.record(step, 0, **sampled)
            continue
        chosen = [side(c, stage.max_seq_len) for c, _, _, _ in pairs]
        rejected = [side(r, stage.max_seq_len) for _, r, _, _ in pairs]
        ref_chosen = reference_of(model, reference, chosen, pad_id, device)
        ref_rejected = reference_of(model, reference, rejected, pad_id, device)
        metrics, tokens = train_step(training.learner, chosen, rejected, torch.tensor(ref_chosen),
                                     torch.tensor(ref_rejected), stage, pad_id)
        training.record(step, tokens, **metrics, **sampled)
        sided = zip(pairs, ref_chosen, ref_rejected, chosen, rejected)
        rows += [pair_row(step, i, *pair, ref_c, ref_r, sides) for i, (pair, ref_c, ref_r, *sides) in enumerate(sided)]
    ctx.log(f"{stats.pairs} pairs from {stats.prompts} prompts ({stats.dropped_tied} tied and "
            f"{stats.dropped_unscored} unscored dropped)")
    if not rows:  # the rubric never told two completions apart: nothing was trained
        raise NoTrainingData(f"no preference pairs in {stats.prompts} prompts sampled online: every prompt's two "
                             f"completions tied ({stats.dropped_tied}) or were unscored ({stats.dropped_unscored})")
    pairs_dir = ctx.workdir / "pairs"
    write_rows(rows, pairs_dir)
    trained = [h for h in training.history if "loss" in h]
    outputs = training.finish({"method": stage.method, "beta": stage.beta, "mode": "online", "pairs": stats.pairs,
                               "dropped_tied": stats.dropped_tied, "dropped_unscored": stats.dropped_unscored,
                               "final_loss": trained[-1]["loss"] if trained else None,
                               "final_sampled_reward": training.history[-1]["sampled_reward"]})
    return {**outputs, "pairs": StageOutput("dataset", pairs_dir, vars(stats), pairs_contract(ctx))}
