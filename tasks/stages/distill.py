"""`distill`: on-policy distillation (TRL's GKD) from a teacher checkpoint into a student.

Every step draws `batch_size` train prompts from the stage's envs by weight; with probability
`lmbda` (a pure function of seed and step, so a resumed stage draws the same) the student samples
a completion of each (whole episodes: a multi-turn env's own tokens are masked), otherwise the
step trains on `batch_size` rows of `data`, a dataset's own completions (TRL's off-policy share).
The teacher scores the same tokens, and the student takes one step of the generalized JSD between
the two next-token distributions at every completion token (models/distill_losses.py; `beta` 0:
forward KL, 1: reverse KL). The teacher must share the student's tokenizer: the distributions are
compared over one vocabulary, so a different one is refused before training.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from models.distill_losses import distill_loss
from models.loading import base_identity, load_model, load_tokenizer, resolve_base, set_threads
from models.losses import IGNORE_INDEX
from models.sampling import SamplingParams
from tasks.common.context import StageContext, StageOutput
from tasks.common.datasets import read_rows
from tasks.common.encoding import Example, collate, encode_ids, encode_row
from tasks.common.errors import ConfigMismatch, NoTrainingData
from tasks.config import ONE_SEQUENCE_ONLY, PLOT_MODULES, SpecView, TrainStage
from tasks.rollout.envs import stage_env
from tasks.rollout.episodes import TASK_POOL, LocalPolicy, roll_out, step_tasks
from tasks.rollout.scoring import prefetch_scores, score_episode
from tasks.train.loop import batch_indices, start_training

SEEDS_PER_STEP = 1_000_003  # episode seeds of a step: a block of their own
ENDPOINT_TEACHER = ("a checkpoint stage's id: the JSD compares the teacher's whole next-token distribution at every "
                    "token, which an endpoint's top-k log-probs do not give")


class TeacherModel(BaseModel):
    """A teacher outside the spec's stages: a preset, a local folder or a hub id (full weights, loaded
    as `model.base` is), e.g. a larger model of the student's family."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field(min_length=1)


Teacher = Annotated[Annotated[str, Tag("stage")] | Annotated[TeacherModel, Tag("model")],
                    Discriminator(lambda value: "model" if isinstance(value, (dict, TeacherModel)) else "stage")]


class DistillStage(TrainStage):
    """On-policy distillation: the student samples, a teacher checkpoint scores its tokens."""

    outputs = ("checkpoint", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints

    kind: Literal["distill"]
    student: str | None = None  # a checkpoint stage; the spec's base model when absent
    teacher: Teacher  # a checkpoint stage, or {base: MODEL}; sharing the student's tokenizer
    envs: dict[str, Annotated[float, Field(gt=0)]] = Field(min_length=1)  # env id -> weight: the prompts
    data: str | None = None  # a dataset stage: the completions of the off-policy steps (lmbda < 1)
    beta: float = Field(0.5, ge=0, le=1)  # the JSD's interpolation: 0 forward KL, 1 reverse KL (TRL's GKD)
    lmbda: float = Field(1.0, ge=0, le=1)  # the share of steps on the student's own samples (TRL's GKD)
    temperature: float = Field(0.9, gt=0)  # sampling the student's completions (TRL's GKD default)
    max_new_tokens: int = Field(64, gt=0)  # per action
    max_steps: int = Field(gt=0)
    batch_size: int = Field(8, gt=0)  # prompts (or data rows) a step
    max_seq_len: int = Field(256, gt=8)  # prompt + completion, cut beyond
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(5, ge=0)

    @field_validator("teacher", mode="before")
    @classmethod
    def _checkpoint_teacher(cls, teacher):
        if isinstance(teacher, dict) and "base" not in teacher:
            raise ValueError(f"an endpoint cannot be a teacher here; give {ENDPOINT_TEACHER}, or {{base: MODEL}}")
        return teacher

    @model_validator(mode="after")
    def _consistent(self):
        if self.teacher == self.student:
            raise ValueError(f"teacher and student are the same checkpoint ({self.teacher!r}): nothing to distil")
        if self.lmbda < 1 and self.data is None:
            raise ValueError(f"lmbda ({self.lmbda}) below 1 trains that share of the steps on a dataset's own "
                             "completions: give data (a dataset stage), or lmbda: 1")
        if self.lmbda == 1 and self.data is not None:
            raise ValueError("data is read only by off-policy steps, and lmbda: 1 makes every step on-policy: set "
                             "lmbda below 1, or drop data")
        return self

    def reads_base_model(self) -> bool:
        return self.student is None

    def params(self) -> dict:
        """An outside teacher by its identity (a preset's digest, a folder's files), as `model.base` is keyed."""
        params = super().params()
        if isinstance(self.teacher, TeacherModel):
            params["teacher"] = {"base": base_identity(self.teacher.base)}
        return params

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs]

    def stage_refs(self):
        refs = [("teacher", self.teacher, "checkpoint")] if isinstance(self.teacher, str) else []
        if self.student is not None:
            refs.append(("student", self.student, "checkpoint"))
        if self.data is not None:
            refs.append(("data", self.data, "dataset"))
        return refs

    def check_spec(self, spec: SpecView) -> None:
        """The student samples and trains in one process; an episode must be one token sequence."""
        super().check_spec(spec)
        if spec.gpus(self) > 1:
            raise spec.error(self.id, "gpus", f"a distill stage samples and trains one model in one process; it has "
                                              f"gpus {spec.gpus(self)}: give it gpus: 1")
        for env_id in self.envs:
            if spec.env_class(env_id).restarts_context:
                raise spec.error(self.id, f"envs.{env_id}", f"env {env_id!r} ({spec.envs[env_id].kind}) "
                                                            f"{ONE_SEQUENCE_ONLY}")


class TeacherMismatch(ConfigMismatch):
    """A teacher whose tokenizer is not the student's (one line; retrying cannot fix it)."""


def check_teacher_tokenizer(teacher_tokenizer, student_tokenizer) -> None:
    """The JSD compares two distributions over one vocabulary: refused (one line) unless the teacher's
    tokens and special tokens are the student's, id for id."""
    ours, theirs = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    differ = sorted(set(ours.items()) ^ set(theirs.items()))[:1]
    specials = [name for name in ("eos_token_id", "pad_token_id", "bos_token_id")
                if getattr(teacher_tokenizer, name) != getattr(student_tokenizer, name)]
    if differ or specials:
        first = f"first difference: {differ[0][0]!r}" if differ else f"{specials[0]} differs"
        raise TeacherMismatch(f"teacher: its tokenizer is not the student's ({len(ours)} vs {len(theirs)} tokens; "
                              f"{first}); distillation compares next-token distributions over one vocabulary: "
                              "distil from a checkpoint of the student's base model")


def check_vocabulary_width(teacher, student) -> None:
    """The two models' logits must be as wide (one tokenizer, but embeddings padded differently are refused)."""
    widths = teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if widths[0] != widths[1]:
        raise TeacherMismatch(f"teacher: its logits are {widths[0]} wide, the student's {widths[1]}: the JSD compares "
                              "distributions over one vocabulary")


def on_policy(stage: DistillStage, step: int) -> bool:
    """Whether step `step` trains on the student's own samples: probability `lmbda`, seeded per step."""
    return stage.lmbda == 1 or random.Random(f"distill:{stage.seed}:{step}").random() < stage.lmbda


class StudentSampler:
    """What an on-policy step samples: the envs, their pools of train tasks, the student as a policy."""

    def __init__(self, stage: DistillStage, envs: dict, policy, tokenizer):
        self.stage, self.envs, self.policy, self.tokenizer = stage, envs, policy, tokenizer
        self.pools = {env_id: env.tasks("train", TASK_POOL, stage.seed) for env_id, env in envs.items()}
        self.params = SamplingParams(stage.max_new_tokens, stage.temperature)

    def examples(self, step: int) -> tuple[list[Example], dict]:
        """The step's completions as examples (the policy's tokens scored) and their mean reward."""
        picked = step_tasks(self.pools, self.stage.envs, self.stage.batch_size, self.stage.seed, step,
                            stream="distill")
        first_seed = (self.stage.seed * SEEDS_PER_STEP + step) * self.stage.batch_size
        examples, rewards = [], []
        for env_id, env in self.envs.items():
            indices = [i for i, (picked_env, _) in enumerate(picked) if picked_env == env_id]
            if not indices:
                continue
            trajectories = roll_out(self.policy, self.tokenizer, env, [picked[i][1] for i in indices], self.params,
                                    episode_seeds=[first_seed + i for i in indices])
            prefetch_scores(trajectories, env)
            rewards += [score_episode(trajectory, env).reward for trajectory in trajectories]
            examples += [sampled_example(t, self.stage.max_seq_len) for t in trajectories]
        finite = [reward for reward in rewards if math.isfinite(reward)]
        return examples, {"sampled_reward": sum(finite) / len(finite) if finite else math.nan}


def sampled_example(trajectory, max_len: int) -> Example:
    """An episode as the loss reads it: the prompt masked, the policy's tokens scored, the env's masked."""
    ids, mask = trajectory.completion()
    return encode_ids(trajectory.prompt_ids, ids, max_len, mask)


def dataset_examples(stage: DistillStage, ctx: StageContext, tokenizer) -> list[Example]:
    """The rows of `data` as examples (their completions scored); none without `data`."""
    if stage.data is None:
        return []
    rows = read_rows(ctx.fetch(stage.data))
    if rows and not set(rows[0]) & {"completion", "messages", "text", "token_ids"}:
        raise NoTrainingData(f"data {stage.data!r} holds no completions ({', '.join(sorted(rows[0]))}); the "
                             "off-policy steps train on text, prompt_completion or messages data")
    examples = [encode_row(tokenizer, row, stage.max_seq_len) for row in rows]
    if not examples:
        raise NoTrainingData(f"data {stage.data!r} has no rows for the off-policy steps (lmbda {stage.lmbda})")
    return examples


def jsd_loss(student, teacher, ids, mask, labels, beta: float, denominator: float | None = None):
    """The JSD of one micro-batch over its scored tokens (labels not IGNORE_INDEX): the logits at t
    predict the token at t + 1, the teacher's without gradient."""
    import torch

    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1]
    student_logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return distill_loss(student_logits, teacher_logits, labels[:, 1:] != IGNORE_INDEX, beta, denominator=denominator)


def train_step(learner, teacher, examples: list[Example], stage: DistillStage, pad_id: int) -> tuple[float, int]:
    """One optimizer step of the JSD over the examples' scored tokens, in micro-batches; returns (the
    mean JSD per scored token, the tokens processed)."""
    step_tokens = sum(example.scored_tokens for example in examples)
    total, seen = 0.0, 0
    pieces = learner.pieces(examples)
    for index, piece in enumerate(pieces):
        ids, mask, labels = collate(piece, pad_id, learner.accelerator.device)
        with learner.accelerator.autocast():
            loss = jsd_loss(learner.model, teacher, ids, mask, labels, stage.beta, step_tokens)
        learner.backward(loss, last=index == len(pieces) - 1)
        total += loss.item()
        seen += int(mask.sum())
    learner.update()
    return total, seen


def run(stage: DistillStage, ctx: StageContext) -> dict[str, StageOutput]:
    import torch

    set_threads(ctx.model)
    source = str(ctx.fetch(stage.student)) if stage.student else resolve_base(ctx.model.base)
    tokenizer = load_tokenizer(source, ctx.model)
    teacher_dir = str(ctx.fetch(stage.teacher)) if isinstance(stage.teacher, str) else resolve_base(stage.teacher.base)
    check_teacher_tokenizer(load_tokenizer(teacher_dir, ctx.model), tokenizer)
    envs = {env_id: stage_env(ctx, env_id, tokenizer) for env_id in stage.envs}
    offline = dataset_examples(stage, ctx, tokenizer)
    training = start_training(ctx, stage, source, stage.max_steps, tokenizer)
    if training.accelerator.num_processes > 1:
        raise ValueError("a distill stage runs in one process (its sampling and its update share one model)")
    device, pad_id = training.accelerator.device, tokenizer.pad_token_id
    teacher = load_model(teacher_dir, ctx.model).to(device).eval().requires_grad_(False)
    check_vocabulary_width(teacher, training.accelerator.unwrap_model(training.model))
    model = training.accelerator.unwrap_model(training.model)
    sampler = StudentSampler(stage, envs, LocalPolicy(model, tokenizer, stage.batch_size), tokenizer)
    for step in range(training.start, training.steps):
        sampled = on_policy(stage, step)
        if sampled:
            model.eval()
            with torch.no_grad():
                examples, metrics = sampler.examples(step)
            model.train()
        else:
            examples, metrics = [offline[i] for i in batch_indices(len(offline), stage.batch_size, stage.seed,
                                                                   step)], {}
        loss, tokens = train_step(training.learner, teacher, examples, stage, pad_id)
        training.record(step, tokens, loss=loss, on_policy=float(sampled), **metrics)
    history = training.history
    sampled_rewards = [h["sampled_reward"] for h in history if "sampled_reward" in h]
    return training.finish({"beta": stage.beta, "lmbda": stage.lmbda, "first_loss": history[0]["loss"],
                            "final_loss": history[-1]["loss"],
                            "on_policy_steps": sum(1 for h in history if h["on_policy"]),
                            "final_sampled_reward": sampled_rewards[-1] if sampled_rewards else None})
