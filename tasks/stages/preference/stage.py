"""`preference`: alignment on on-policy data (Liquid's phase 2), resumable like sft.

From a rollouts dataset, per prompt: chosen = the best-scored completion, rejected = the
worst (ties broken towards the shorter chosen and the longer rejected, so a looping greedy
completion is the one rejected). Groups whose best and worst scores tie, and groups with
fewer than two finite scores, are dropped and counted. A user's preference dataset (the dataset
stage) gives its pairs as they are. Several datasets mix by weight, as in sft.

The input checkpoint is the reference. Its log-probs of every pair are computed once,
before the first step, and stored in the pairs dataset, which is committed next to the
checkpoint as `<stage>.pairs`: no reference model stays in memory while training.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from data_contracts.config import ContractParams
from models.loading import context_length, load_model, load_tokenizer, resolve_base, set_threads
from models.losses import IGNORE_INDEX, preference_loss
from models.token_logps import label_logps, runs_directly, shared_prefix_logps
from models.sampling import chat_prompt
from tasks.common import contract_gate
from tasks.common.context import StageContext, StageOutput
from tasks.common.contract_gate import ContractViolation
from tasks.common.datasets import write_rows
from tasks.common.encoding import Example, collate, encode_ids, preference_examples
from tasks.common.learner import PIECE_OVERHEAD_TOKENS, Learner, length_buckets
from tasks.common.pairs import input_pairs, preference_pairs  # noqa: F401 (preference_pairs: the stage's API)
from tasks.common.training import mixed_batch_indices, start_training, total_steps
from tasks.config import PLOT_MODULES, DatasetTrainStage, SpecView


class PreferenceStage(DatasetTrainStage):
    """Preference alignment, DPO-family loss. `offline`: on the pairs of its datasets (best vs worst
    completion per prompt of rollouts, or a user's pairs); the input checkpoint `policy` is the
    reference, its log-probs of every pair computed once, before training, and stored with the
    pairs. `online` (TRL's online DPO): every step samples two completions per prompt of its `envs`
    from the model being trained, their rubric (a reward model, a judge, a verifier) picks the pair,
    and the reference's log-probs are computed on the spot (tasks/stages/preference/online.py).
    """

    outputs = ("checkpoint", "pairs", "report")
    primary = "checkpoint"
    produces = "checkpoint"
    preload = ("peft", "accelerate", *PLOT_MODULES)  # curves at checkpoints
    runs = "tasks.stages.preference"  # the package: its `run` is stage.py's

    kind: Literal["preference"]
    policy: str
    mode: Literal["offline", "online"] = "offline"
    data: str | list[str] | dict[str, Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)  # offline
    envs: dict[str, Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)  # online: env id -> weight
    method: Literal["dpo", "ln_dpo", "ipo"] = "dpo"
    beta: float = Field(0.1, gt=0)
    min_reward_gap: float = Field(0.0, ge=0)  # pairs need chosen - rejected reward above this
    learning_rate: float = Field(2e-5, gt=0)
    batch_size: int = Field(16, gt=0)  # pairs a step (online: prompts a step)
    warmup_steps: int = Field(10, ge=0)
    max_seq_len: int = Field(256, gt=8)
    temperature: float = Field(1.0, gt=0)  # online: sampling the two completions
    max_tokens: int = Field(64, gt=0)  # online: per action

    @model_validator(mode="after")
    def _mode_inputs(self):
        if self.mode == "offline" and (self.data is None or self.envs is not None):
            raise ValueError("mode: offline trains on the pairs of `data` (generate stages or preference "
                             "datasets); `envs` is for mode: online")
        if self.mode == "online":
            if self.envs is None or self.data is not None:
                raise ValueError("mode: online samples its pairs from `envs` ({env id: weight}) every step; "
                                 "`data` is for mode: offline")
            if self.max_steps is None:
                raise ValueError("mode: online needs max_steps (it has no dataset to count epochs over)")
        return self

    def datasets(self) -> list[str]:
        return [] if self.data is None else super().datasets()

    def env_refs(self):
        return [(f"envs.{env_id}", env_id) for env_id in self.envs or {}]

    def stage_refs(self):
        # data: generate stages, or imported preference datasets
        return [("policy", self.policy, "checkpoint"), *(self.data_refs(("rollouts", "preference dataset"))
                                                         if self.data is not None else [])]

    def check_spec(self, spec: SpecView) -> None:
        """Every prompt group of its rollouts must hold completions to pick a best and a worst from."""
        super().check_spec(spec)
        for data in self.datasets():
            if spec.stage(data).output_kind() == "rollouts":
                spec.stage(data).check_pairable(spec, self.id)


REFERENCE_BATCH = 64


def encode_pairs(tokenizer, pairs: list[dict], max_len: int) -> tuple[list[Example], list[Example]]:
    chosen, rejected = [], []
    for pair in pairs:
        if "chosen_tokens" not in pair:  # an imported pair: text or conversations, through the chat template
            sides = preference_examples(tokenizer, pair, max_len)
            chosen.append(sides[0])
            rejected.append(sides[1])
            continue
        prompt_ids = chat_prompt(tokenizer, pair["prompt"])
        multi_turn = "chosen_mask" in pair  # env-written tokens of multi-turn episodes are not scored
        chosen.append(encode_ids(prompt_ids, pair["chosen_tokens"], max_len,
                                 pair["chosen_mask"] if multi_turn else None))
        rejected.append(encode_ids(prompt_ids, pair["rejected_tokens"], max_len,
                                   pair["rejected_mask"] if multi_turn else None))
    return chosen, rejected


def side_logps(model, examples: list[Example], pad_id: int, device):
    """Summed completion log-probs and completion token counts of one side of a batch of pairs."""
    ids, mask, labels = collate(examples, pad_id, device)
    logps, _, scored = label_logps(model, ids, mask, labels)
    return logps.sum(-1), scored.sum(-1), int(mask.sum())


def bucketed_logps(model, examples: list[Example], pad_id: int, device):
    """side_logps over `examples` in length buckets (one call where lengths are alike), in the order given."""
    import torch

    buckets = length_buckets([(len(e.input_ids),) for e in examples])
    parts = [side_logps(model, [examples[i] for i in bucket], pad_id, device) for bucket in buckets]
    order = torch.tensor([i for bucket in buckets for i in bucket], device=device).argsort()
    return (torch.cat([logps for logps, _, _ in parts])[order], torch.cat([scored for _, scored, _ in parts])[order],
            sum(seen for _, _, seen in parts))


def pair_logps(model, chosen: list[Example], rejected: list[Example], pad_id: int, device, one_call: bool = False):
    """Summed completion log-probs and completion token counts of a micro-batch's pairs (chosen
    rows first), and the non-pad tokens processed. Each pair's shared prompt goes through the model
    once (`shared_prompt_logps`) where that pads less than both sides whole in length buckets (a
    looping rejected side would pad every chosen one to its length) and the model runs directly;
    otherwise both sides whole, in length buckets. `one_call`: both sides whole in one forward (a
    sharded model, whose forwards are collectives: as many on every process)."""
    if one_call:
        return side_logps(model, chosen + rejected, pad_id, device)
    split = [shared_length(c, r) for c, r in zip(chosen, rejected)]
    if runs_directly(model) and min(split, default=0) >= 1 \
            and all(len(e.input_ids) > n for e, n in zip(chosen + rejected, split + split)) \
            and _shared_cost(chosen, rejected, split) < _bucketed_cost(chosen + rejected):
        result = shared_prompt_logps(model, chosen, rejected, split, pad_id, device)
        if result is not None:
            return result
    return bucketed_logps(model, chosen + rejected, pad_id, device)


def shared_prompt_logps(model, chosen: list[Example], rejected: list[Example], split: list[int], pad_id: int,
                        device):
    """As `pair_logps`, each pair's first `split` tokens (its prompt, in both sides) computed once;
    None where the model does not run directly (models/direct_forward.py)."""
    import torch

    prefixes, prefix_mask, _ = collate([Example(c.input_ids[:n], [IGNORE_INDEX] * n, False)
                                        for c, n in zip(chosen, split)], pad_id, device)
    suffixes, suffix_mask, labels = collate([Example(e.input_ids[n:], e.labels[n:], e.truncated)
                                             for e, n in zip(chosen + rejected, split + split)], pad_id, device)
    owner = torch.arange(len(chosen), device=device).repeat(2)
    result = shared_prefix_logps(model, prefixes, prefix_mask, suffixes, suffix_mask, owner, labels)
    if result is None:
        return None
    logps, _, scored = result
    return logps.sum(-1), scored.sum(-1), int(prefix_mask.sum() + suffix_mask.sum())


def _shared_cost(chosen: list[Example], rejected: list[Example], split: list[int]) -> int:
    """Tokens through the model, padding included, with each pair's prompt once (one call)."""
    suffixes = [len(e.input_ids) - n for e, n in zip(chosen + rejected, split + split)]
    return len(chosen) * max(split) + len(suffixes) * max(suffixes) + PIECE_OVERHEAD_TOKENS


def _bucketed_cost(examples: list[Example]) -> int:
    """The same for whole sequences in length buckets (`bucketed_logps`)."""
    lengths = [len(e.input_ids) for e in examples]
    buckets = length_buckets([(n,) for n in lengths])
    return sum(len(bucket) * max(lengths[i] for i in bucket) + PIECE_OVERHEAD_TOKENS for bucket in buckets)


def shared_length(chosen: Example, rejected: Example) -> int:
    """The tokens both sides of a pair begin with before either's first scored token: its prompt."""
    limit = min(_first_scored(chosen), _first_scored(rejected))
    for index, (a, b) in enumerate(zip(chosen.input_ids[:limit], rejected.input_ids[:limit])):
        if a != b:
            return index
    return min(limit, len(chosen.input_ids), len(rejected.input_ids))


def _first_scored(example: Example) -> int:
    return next((t for t, label in enumerate(example.labels) if t >= 1 and label != IGNORE_INDEX),
                len(example.labels))


def reference_logps(model, examples: list[Example], pad_id: int, device) -> list[float]:
    import torch

    model.eval()
    values = []
    with torch.no_grad():
        for start in range(0, len(examples), REFERENCE_BATCH):
            logps, _, _ = side_logps(model, examples[start:start + REFERENCE_BATCH], pad_id, device)
            values += logps.tolist()
    return values


def train_step(learner: Learner, chosen: list[Example], rejected: list[Example], ref_chosen, ref_rejected,
               stage: PreferenceStage, pad_id: int, step_pairs: int | None = None, shards: int = 1) -> tuple[dict, int]:
    """One optimizer step on this process's share of a batch of pairs, in micro-batches of pairs;
    returns (metrics over the step's pairs, non-pad tokens processed: every process's, when they split it).

    The loss is the mean of `preference_loss` over the step's `step_pairs` pairs (every process's
    share; default: this share's), × `shards` (Learner). A micro-batch's chosen and
    rejected sequences go through the model together, regrouped by length (length_buckets):
    pairs of similar lengths in one call, while a looping rejected completion, often twice as
    long as its chosen one, does not pad the chosen side to its length.
    """
    step_pairs = step_pairs or len(chosen)
    device = learner.accelerator.device
    loss_sum, wins, margin_sum, seen = 0.0, 0.0, 0.0, 0
    pieces = learner.equalized(learner.pieces(list(range(len(chosen)))))
    for index, (piece, weight) in enumerate(pieces):
        with learner.accelerator.autocast():
            logps, scored, piece_seen = pair_logps(learner.model, [chosen[i] for i in piece],
                                                   [rejected[i] for i in piece], pad_id, device, learner.sharded)
            n = len(piece)
            losses, chosen_rewards, rejected_rewards = preference_loss(
                stage.method, stage.beta, logps[:n], logps[n:], ref_chosen[piece].to(device),
                ref_rejected[piece].to(device), scored[:n], scored[n:])
        learner.backward(losses.sum() * weight * shards / step_pairs, last=index == len(pieces) - 1)
        if weight:  # a zero-weight piece only keeps a sharded model's collectives in step
            loss_sum += losses.sum().item()
            wins += (chosen_rewards > rejected_rewards).float().sum().item()
            margin_sum += (chosen_rewards - rejected_rewards).sum().item()
            seen += piece_seen
    learner.update()
    loss_sum, wins, margin_sum, seen, pairs = learner.step_totals([loss_sum, wins, margin_sum, seen, len(chosen)],
                                                                  shards)
    return {"loss": loss_sum / pairs, "reward_accuracy": wins / pairs, "reward_margin": margin_sum / pairs}, int(seen)


def run(stage: PreferenceStage, ctx: StageContext) -> dict[str, StageOutput]:
    set_threads(ctx.model)
    source = str(ctx.fetch(stage.policy))
    tokenizer = load_tokenizer(source, ctx.model)
    if stage.mode == "online":
        from tasks.stages.preference.online import run_online

        return run_online(stage, ctx, source, tokenizer)
    return run_offline(stage, ctx, source, tokenizer)


def run_offline(stage: PreferenceStage, ctx: StageContext, source: str, tokenizer) -> dict[str, StageOutput]:
    import torch

    pairs, stats, sizes = input_pairs(ctx, stage.datasets(), stage.min_reward_gap)
    ctx.log(f"{stats.pairs} pairs from {stats.prompts} prompts ({stats.dropped_tied} tied and "
            f"{stats.dropped_unscored} unscored groups dropped)")
    if not pairs:  # retrying cannot fix data
        raise ContractViolation(f"no preference pairs in {', '.join(str(ctx.inputs[d]) for d in stage.datasets())}: "
                                f"all {stats.prompts} prompt "
                                "groups tied or unscored")
    chosen, rejected = encode_pairs(tokenizer, pairs, stage.max_seq_len)
    device = ctx.device
    reference = load_model(source, ctx.model).to(device)
    ref_chosen = reference_logps(reference, chosen, tokenizer.pad_token_id, device)
    ref_rejected = reference_logps(reference, rejected, tokenizer.pad_token_id, device)
    del reference
    for pair, c, r, c_logp, r_logp in zip(pairs, chosen, rejected, ref_chosen, ref_rejected):
        pair.update(ref_chosen_logp=c_logp, ref_rejected_logp=r_logp,
                    total_tokens=max(len(c.input_ids), len(r.input_ids)))

    pairs_dir = ctx.workdir / "pairs"
    write_rows(pairs, pairs_dir)
    contract = ContractParams(kind="preference", context_length=context_length(resolve_base(ctx.model.base)))
    pairs_output = StageOutput("dataset", pairs_dir, vars(stats), contract)
    pairs_output.contract_summary = contract_gate.check(ctx, pairs_output, stage.contract)  # before any training

    ref_chosen, ref_rejected = torch.tensor(ref_chosen), torch.tensor(ref_rejected)
    training = start_training(ctx, stage, source, total_steps(stage, len(pairs)), tokenizer)
    for step in range(training.start, training.steps):
        picked = mixed_batch_indices(sizes, stage.weights(), stage.batch_size, stage.seed, step)
        batch = training.shard(picked)
        metrics, tokens = train_step(training.learner, [chosen[i] for i in batch], [rejected[i] for i in batch],
                                     ref_chosen[batch], ref_rejected[batch], stage, tokenizer.pad_token_id,
                                     len(picked), training.learner.shards(picked))
        training.record(step, tokens, **metrics)

    last = training.history[-1]
    outputs = training.finish({"method": stage.method, "beta": stage.beta, "final_loss": last["loss"],
                               "final_reward_accuracy": last["reward_accuracy"], "pairs": stats.pairs,
                               "truncated_pairs": sum(c.truncated or r.truncated for c, r in zip(chosen, rejected))})
    return {**outputs, "pairs": pairs_output}
