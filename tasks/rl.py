"""`rl`: on-policy RL from verifiable rewards (GRPO family), resumable like sft.

Each step: draw `prompts_per_step` train tasks from the env mix by weight, sample
`group_size` completions of each with the generation engine, score them with the env's
rubric (plus the anti-doom repetition penalty), turn rewards into group advantages, and take
one clipped policy-gradient step (models/rl_losses.py). The prompts of a step are a pure
function of (seed, step), so a resumed stage draws exactly what it would have drawn.

One update per batch for now: the old policy is the current one, so the ratio is 1 and the
clip range (and the clip-fraction metric) only starts to matter with `num_iterations`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from envs.base import RewardFunc, Rubric
from envs.doom import DoomLoopDetector, repetition_excess
from envs.loader import make_env
from models.loading import load_model, load_tokenizer, set_threads
from models.losses import token_logps
from models.rl_losses import group_advantages, grpo_loss, kl_k3
from models.sampling import SamplingParams, chat_prompt, generate_tokens, left_padded
from tasks.config import RlStage
from tasks.stage import StageContext, StageOutput
from tasks.training import optimizer_step, start_training

TASK_POOL = 4096  # train tasks drawn per env; steps sample from it


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool
    reward: float  # NaN when a weighted reward function raised
    correct: bool
    doom_loop: bool
    repetition: float  # the anti-doom term before its weight (0 without anti_doom)


def shaped_rubric(rubric: Rubric, stage: RlStage) -> Rubric:
    """The env's rubric plus the anti-doom repetition penalty (a negative weight)."""
    if stage.anti_doom is None:
        return rubric
    doom = stage.anti_doom
    penalty = RewardFunc("repetition", lambda completion, task: repetition_excess(completion, doom.ngram,
                                                                                 doom.threshold), -doom.penalty)
    return Rubric([*rubric.funcs, penalty])


def step_tasks(pools: dict[str, list], weights: dict[str, float], count: int, seed: int, step: int):
    """(env id, task) pairs of a step: envs drawn by weight, tasks drawn from the env's pool."""
    draw = random.Random(f"rl:{seed}:{step}")
    env_ids = draw.choices(list(weights), weights=list(weights.values()), k=count)
    return [(env_id, pools[env_id][draw.randrange(len(pools[env_id]))]) for env_id in env_ids]


def padded_batch(rollouts: list[Rollout], pad_id: int, device):
    """Left-padded prompts and right-padded completions, with their masks."""
    import torch

    prompt, prompt_mask = left_padded([r.prompt_ids for r in rollouts], pad_id, device)
    width = max(len(r.completion_ids) for r in rollouts)
    completion = torch.full((len(rollouts), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completion)
    for row, r in enumerate(rollouts):
        completion[row, :len(r.completion_ids)] = torch.tensor(r.completion_ids)
        completion_mask[row, :len(r.completion_ids)] = 1
    return prompt, prompt_mask, completion.to(device), completion_mask.to(device)


def completion_logps(model, prompt, prompt_mask, completion, completion_mask, temperature: float):
    """Per-token log-probs [B, T] of the completion tokens under the temperature-scaled policy."""
    import torch

    ids = torch.cat([prompt, completion], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as the sampler numbers left-padded prompts
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return token_logps(logits[:, prompt.size(1) - 1:-1].float() / temperature, completion)


def sample_rollouts(model, tokenizer, envs: dict, rubric_of: dict, picked, stage: RlStage, step: int,
                    detector: DoomLoopDetector) -> list[Rollout]:
    model.eval()
    prompts = [chat_prompt(tokenizer, task.prompt) for _, task in picked]
    generations = generate_tokens(model, tokenizer, [p for p in prompts for _ in range(stage.group_size)],
                                  SamplingParams(stage.max_tokens, stage.temperature),
                                  batch_size=len(prompts) * stage.group_size, seed=stage.seed * 1_000_003 + step)
    model.train()
    rollouts = []
    for i, gen in enumerate(generations):
        env_id, task = picked[i // stage.group_size]
        truncated = gen.finish_reason == "length"
        score = rubric_of[env_id].score(gen.text, task)
        rollouts.append(Rollout(prompts[i // stage.group_size], gen.token_ids, truncated, score.total,
                                envs[env_id].is_correct(gen.text, task), detector.is_loop(gen.text, truncated),
                                score.rewards["repetition"] if stage.anti_doom else 0.0))
    return rollouts


def train_step(training, reference, rollouts: list[Rollout], stage: RlStage, pad_id: int) -> tuple[dict, int]:
    """One clipped policy-gradient step on a step's rollouts; returns (metrics, completion tokens)."""
    import torch

    device = training.accelerator.device
    rewards = torch.tensor([r.reward for r in rollouts])
    advantages = group_advantages(rewards, stage.group_size, stage.scale_rewards).to(device)
    prompt, prompt_mask, completion, completion_mask = padded_batch(rollouts, pad_id, device)
    mask = completion_mask.clone()
    if stage.mask_truncated:
        mask[torch.tensor([r.truncated for r in rollouts], device=device)] = 0
    logps = completion_logps(training.model, prompt, prompt_mask, completion, completion_mask, stage.temperature)
    ref_logps = None
    if stage.beta:
        with torch.no_grad():
            ref_logps = completion_logps(reference, prompt, prompt_mask, completion, completion_mask,
                                         stage.temperature)
    loss, clip_fraction = grpo_loss(logps, logps.detach(), advantages, mask, epsilon_low=stage.epsilon_low,
                                    epsilon_high=stage.epsilon_high, aggregation=stage.loss_aggregation,
                                    max_completion_length=stage.max_tokens, ref_logps=ref_logps, beta=stage.beta)
    optimizer_step(training.model, loss, training.accelerator, training.optimizer, training.scheduler)
    finite = [r.reward for r in rollouts if math.isfinite(r.reward)]
    metrics = {"loss": loss.item(), "reward": sum(finite) / max(1, len(finite)),
               "accuracy": sum(r.correct for r in rollouts) / len(rollouts),
               "doom_loop_rate": sum(r.doom_loop for r in rollouts) / len(rollouts),
               "truncated_rate": sum(r.truncated for r in rollouts) / len(rollouts),
               "repetition": sum(r.repetition for r in rollouts) / len(rollouts),
               "clip_fraction": clip_fraction.item()}
    if ref_logps is not None:
        kl = kl_k3(logps.detach(), ref_logps)
        metrics["kl"] = ((kl * completion_mask).sum() / completion_mask.sum()).item()
    return metrics, int(completion_mask.sum())


def run(stage: RlStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source)
    envs = {env_id: make_env(env_id, ctx.envs[env_id]) for env_id in stage.envs}
    rubric_of = {env_id: shaped_rubric(env.rubric, stage) for env_id, env in envs.items()}
    pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
    training = start_training(ctx, stage, source, stage.steps)
    reference = load_model(source, ctx.model).to(training.accelerator.device).eval() if stage.beta else None
    detector = DoomLoopDetector()
    for step in range(training.start, stage.steps):
        picked = step_tasks(pools, stage.envs, stage.prompts_per_step, stage.seed, step)
        rollouts = sample_rollouts(training.accelerator.unwrap_model(training.model), tokenizer, envs, rubric_of,
                                   picked, stage, step, detector)
        metrics, tokens = train_step(training, reference, rollouts, stage, tokenizer.pad_token_id)
        training.record(step, tokens, **metrics)
    out_dir = ctx.workdir / "checkpoint"
    history = training.history
    last = history[-10:]
    metrics = {**training.save(tokenizer, out_dir), "algorithm": stage.algorithm,
               "final_reward": sum(h["reward"] for h in last) / len(last),
               "final_accuracy": sum(h["accuracy"] for h in last) / len(last),
               "first_reward": history[0]["reward"]}
    return {"checkpoint": StageOutput("checkpoint", out_dir, metrics)}
