"""`reward_model`: a scalar reward model trained on preference pairs (Bradley–Terry), resumable
like sft: TRL's RewardTrainer as a stage.

Its data: a user's preference datasets (TRL's formats, conversational included) or rollouts
(generate), paired as the preference stage pairs them (tasks/common/pairs.py) or every pair of a
group (`rollout_pairs: all`), mixed by weight.
The model: the input checkpoint (or the spec's base model) with a new one-output score head
(transformers' sequence classification), LoRA or full as the spec's `model.lora` says; a LoRA
reward model trains and saves its whole head. `eval_fraction` of the pairs (by a hash of the
pair's id, or its group's) is held out: the stage reports the pairwise accuracy on them (chosen scored above
rejected) at every checkpoint and at the end. The result is committed as a `reward_model`
artifact, which rewards a dataset env's completions (`rewards: [{reward_model: STAGE_ID}]`,
tasks/rollout/learned_rewards.py) and which no policy evaluation is triggered for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from models.loading import load_tokenizer, resolve_base, set_threads
from models.losses import reward_model_loss
from tasks.common.context import StageContext, StageOutput
from tasks.common.encoding import Example, preference_examples
from tasks.common.errors import NoTrainingData
from tasks.common.pairs import input_pairs, split_key
from tasks.config import PLOT_MODULES, DatasetTrainStage
from tasks.rollout.reward_models import held_out, reward_scores, scores_in_batches
from tasks.train.learner import Learner
from tasks.train.loop import mixed_batch_indices, start_training, total_steps


class RewardModelStage(DatasetTrainStage):
    """A scalar reward model on preference pairs: −log σ(r_chosen − r_rejected) (+ TRL's optional
    centering term), its pairwise accuracy on held-out pairs reported."""

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "reward model"
    preload = ("peft", "accelerate", *PLOT_MODULES)

    kind: Literal["reward_model"]
    policy: str | None = None  # the checkpoint whose backbone it starts from; the spec's base model when absent
    eval_fraction: float = Field(0.1, ge=0, lt=1)  # pairs held out for the pairwise accuracy
    center_rewards_coefficient: float | None = Field(None, ge=0)  # TRL's: pulls scores towards 0
    min_reward_gap: float = Field(0.0, ge=0)  # rollouts: pairs need chosen - rejected reward above this
    # rollouts: a group's best vs its worst completion (as preference stages pair them), or every
    # completion vs each one scored lower (InstructGPT's comparisons: more of the policy's mistakes)
    rollout_pairs: Literal["best_vs_worst", "all"] = "best_vs_worst"
    learning_rate: float = Field(1e-4, gt=0)
    batch_size: int = Field(16, gt=0)
    warmup_steps: int = Field(10, ge=0)
    max_seq_len: int = Field(256, gt=8)

    def reads_base_model(self) -> bool:
        return self.policy is None

    def stage_refs(self):
        refs = self.data_refs(("rollouts", "preference dataset"))
        if self.policy is not None:
            refs.append(("policy", self.policy, "checkpoint"))
        return refs


def train_step(learner: Learner, chosen: list[Example], rejected: list[Example], stage: RewardModelStage,
               pad_id: int, step_pairs: int, shards: int = 1) -> dict:
    """One optimizer step on this process's share of a batch of pairs, in micro-batches of pairs;
    the loss is the mean of `reward_model_loss` over the step's `step_pairs` pairs (× `shards`:
    tasks/train/learner.py). A micro-batch's chosen and rejected sides go through the model in one
    forward, as in TRL."""
    device = learner.accelerator.device
    loss_sum, wins, margin_sum = 0.0, 0.0, 0.0
    pieces = learner.equalized(learner.pieces(list(range(len(chosen)))))
    for index, (piece, weight) in enumerate(pieces):
        with learner.accelerator.autocast():
            scores = reward_scores(learner.model, [chosen[i] for i in piece] + [rejected[i] for i in piece],
                                   pad_id, device)
            good, bad = scores[:len(piece)], scores[len(piece):]
            losses = reward_model_loss(good, bad, center_coefficient=stage.center_rewards_coefficient)
        learner.backward(losses.sum() * weight * shards / step_pairs, last=index == len(pieces) - 1)
        if weight:  # a zero-weight piece only keeps a sharded model's collectives in step
            loss_sum += losses.sum().item()
            wins += (good > bad).float().sum().item()
            margin_sum += (good - bad).sum().item()
    learner.update()
    loss_sum, wins, margin_sum, pairs = learner.step_totals([loss_sum, wins, margin_sum, len(chosen)], shards)
    return {"loss": loss_sum / pairs, "accuracy": wins / pairs, "margin": margin_sum / pairs}


def pairwise_accuracy(model, chosen: list[Example], rejected: list[Example], pad_id: int, device) -> dict:
    """Share of pairs whose chosen side the model scores above the rejected one, and the mean margin."""
    if not chosen:
        return {}
    good = scores_in_batches(model, chosen, pad_id, device)
    bad = scores_in_batches(model, rejected, pad_id, device)
    return {"eval_accuracy": sum(g > b for g, b in zip(good, bad)) / len(good),
            "eval_margin": sum(g - b for g, b in zip(good, bad)) / len(good)}


def run(stage: RewardModelStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy)) if stage.policy else resolve_base(ctx.model.base)
    tokenizer = load_tokenizer(source, ctx.model)
    pairs, stats, per_dataset = input_pairs(ctx, stage.datasets(), stage.min_reward_gap,
                                            every_pair=stage.rollout_pairs == "all")
    sides = [preference_examples(tokenizer, pair, stage.max_seq_len) for pair in pairs]
    split = [held_out(split_key(pair), stage.eval_fraction) for pair in pairs]
    train = [i for i, out in enumerate(split) if not out]  # in dataset order, as the pairs
    held = [i for i, out in enumerate(split) if out]
    ctx.log(f"{len(train)} training and {len(held)} held-out pairs ({stats.dropped_tied} tied and "
            f"{stats.dropped_unscored} unscored groups dropped)")
    if not train:  # retrying cannot fix data
        raise NoTrainingData(f"no training pairs for the reward model in {', '.join(stage.datasets())} "
                                f"({len(pairs)} pairs, {len(held)} held out)")
    owner = [d for d, size in enumerate(per_dataset) for _ in range(size)]
    sizes = [sum(1 for i in train if owner[i] == d) for d in range(len(per_dataset))]
    held_chosen, held_rejected = [sides[i][0] for i in held], [sides[i][1] for i in held]
    training = start_training(ctx, stage, source, total_steps(stage, len(train)), tokenizer, reward_head=True)
    pad_id, device = tokenizer.pad_token_id, training.accelerator.device
    for step in range(training.start, training.steps):
        picked = [train[i] for i in mixed_batch_indices(sizes, stage.weights(), stage.batch_size, stage.seed, step)]
        batch = training.shard(picked)
        metrics = train_step(training.learner, [sides[i][0] for i in batch], [sides[i][1] for i in batch], stage,
                             pad_id, len(picked), training.learner.shards(picked))
        if (step + 1) % stage.checkpoint_every == 0 or step + 1 == training.steps:
            metrics.update(pairwise_accuracy(training.model, held_chosen, held_rejected, pad_id, device))
        tokens = sum(len(sides[i][0].input_ids) + len(sides[i][1].input_ids) for i in picked)
        training.record(step, tokens, **metrics)
    last = training.history[-1]
    return training.finish({"final_loss": last["loss"], "final_accuracy": last["accuracy"],
                            "eval_accuracy": last.get("eval_accuracy"), "eval_margin": last.get("eval_margin"),
                            "train_pairs": len(train), "eval_pairs": len(held),
                            "truncated_pairs": sum(c.truncated or r.truncated for c, r in sides)})
