"""A preference step: pairs encoded as the loss reads them, their log-probs (shared prompts once, length
buckets, the reference's before training), and one optimizer step of the DPO-family loss
(models/losses.py)."""

from __future__ import annotations

from data_contracts.config import ContractParams
from models.loading import context_length, resolve_base
from models.losses import IGNORE_INDEX, preference_loss
from models.sampling import chat_prompt
from models.token_logps import label_logps, runs_directly, shared_prefix_logps
from tasks.common.context import StageContext
from tasks.common.encoding import Example, collate, encode_ids, preference_examples
from tasks.stages.preference.config import PreferenceStage
from tasks.train.held_out import measuring
from tasks.train.learner import PIECE_OVERHEAD_TOKENS, Learner, length_buckets

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


def held_out_pairs(model, chosen: list[Example], rejected: list[Example], ref_chosen, ref_rejected,
                   stage: PreferenceStage, pad_id: int, device, one_call: bool = False) -> dict[str, float]:
    """The preference loss and reward accuracy over held-out pairs (never trained on), in batches of
    the stage's size, without gradients; `one_call` as in `pair_logps`."""
    loss_sum, wins = 0.0, 0.0
    with measuring(model):
        for start in range(0, len(chosen), stage.batch_size):
            piece = list(range(start, min(len(chosen), start + stage.batch_size)))
            logps, scored, _ = pair_logps(model, [chosen[i] for i in piece], [rejected[i] for i in piece], pad_id,
                                          device, one_call)
            n = len(piece)
            losses, chosen_rewards, rejected_rewards = preference_loss(
                stage.method, stage.beta, logps[:n], logps[n:], ref_chosen[piece].to(device),
                ref_rejected[piece].to(device), scored[:n], scored[n:])
            loss_sum += losses.sum().item()
            wins += (chosen_rewards > rejected_rewards).float().sum().item()
    return {"loss": loss_sum / len(chosen), "reward_accuracy": wins / len(chosen)}


def pairs_contract(ctx: StageContext) -> ContractParams:
    """The contract of the pairs a preference stage trained on (offline and online alike)."""
    return ContractParams(kind="preference", context_length=context_length(resolve_base(ctx.model.base)))
