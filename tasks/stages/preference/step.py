"""A preference step: pairs encoded as the loss reads them, their log-probs (shared prompts once, length
buckets, the reference's before training), and one optimizer step of the method's loss on pairs
(models/losses.py: the DPO family against the reference, orpo, simpo and cpo without one). kto's
step, on unpaired rows, is tasks/stages/preference/kto.py."""

from __future__ import annotations

from data_contracts.config import ContractParams
from models.loading import context_length, resolve_base
from models.losses import IGNORE_INDEX, preference_loss, reference_free_loss
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
    limit = min(first_scored(chosen), first_scored(rejected))
    for index, (a, b) in enumerate(zip(chosen.input_ids[:limit], rejected.input_ids[:limit])):
        if a != b:
            return index
    return min(limit, len(chosen.input_ids), len(rejected.input_ids))


def first_scored(example: Example) -> int:
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

    The loss is the mean of the method's per-pair loss over the step's `step_pairs` pairs (every
    process's share; default: this share's), plus for orpo and cpo the NLL term of the chosen side
    over the step's chosen tokens, × `shards` (Learner). A micro-batch's chosen and rejected
    sequences go through the model together, regrouped by length (length_buckets): pairs of similar
    lengths in one call, while a looping rejected completion, often twice as long as its chosen one,
    does not pad the chosen side to its length. `ref_chosen`, `ref_rejected`: None for a
    reference-free method.
    """
    step_pairs = step_pairs or len(chosen)
    device = learner.accelerator.device
    weight_nll = nll_weight(stage)
    step_nll_tokens = learner.step_totals([nll_tokens(stage, chosen)], shards)[0] if weight_nll else 1
    loss_sum, nll_sum, wins, margin_sum, seen = 0.0, 0.0, 0.0, 0.0, 0
    pieces = learner.equalized(learner.pieces(list(range(len(chosen)))))
    for index, (piece, weight) in enumerate(pieces):
        with learner.accelerator.autocast():
            losses, chosen_rewards, rejected_rewards, nll_logps, piece_seen = piece_losses(
                learner.model, [chosen[i] for i in piece], [rejected[i] for i in piece], sliced(ref_chosen, piece),
                sliced(ref_rejected, piece), stage, pad_id, device, learner.sharded)
        loss = losses.sum() / step_pairs - weight_nll * nll_logps / step_nll_tokens
        learner.backward(loss * weight * shards, last=index == len(pieces) - 1)
        if weight:  # a zero-weight piece only keeps a sharded model's collectives in step
            loss_sum += losses.sum().item()
            nll_sum -= nll_logps.item()
            wins += (chosen_rewards > rejected_rewards).float().sum().item()
            margin_sum += (chosen_rewards - rejected_rewards).sum().item()
            seen += piece_seen
    learner.update()
    loss_sum, nll_sum, wins, margin_sum, seen, pairs = learner.step_totals(
        [loss_sum, nll_sum, wins, margin_sum, seen, len(chosen)], shards)
    return {"loss": loss_sum / pairs + weight_nll * nll_sum / step_nll_tokens, "reward_accuracy": wins / pairs,
            "reward_margin": margin_sum / pairs,
            **({"nll_loss": nll_sum / step_nll_tokens} if weight_nll else {})}, int(seen)


def piece_losses(model, chosen: list[Example], rejected: list[Example], ref_chosen, ref_rejected,
                 stage: PreferenceStage, pad_id: int, device, one_call: bool):
    """A micro-batch's per-pair losses [n], chosen and rejected rewards [n], the summed log-probs of
    what the NLL term of orpo and cpo averages over (orpo: each chosen sequence whole, prompt
    included, as TRL's ORPOTrainer; cpo: the chosen completions; a zero for the others), and the non-pad
    tokens processed."""
    n = len(chosen)
    if stage.method == "orpo":
        chosen_logps, chosen_tokens, nll_logps, seen = whole_sequence_logps(model, chosen, pad_id, device)
        rejected_logps, rejected_tokens, rejected_seen = (side_logps if one_call else bucketed_logps)(
            model, rejected, pad_id, device)
        seen += rejected_seen
    else:
        logps, scored, seen = pair_logps(model, chosen, rejected, pad_id, device, one_call)
        chosen_logps, rejected_logps, chosen_tokens, rejected_tokens = logps[:n], logps[n:], scored[:n], scored[n:]
        nll_logps = chosen_logps.sum() if stage.method == "cpo" else chosen_logps.new_zeros(())
    if stage.reference_free:
        losses, chosen_rewards, rejected_rewards = reference_free_loss(
            stage.method, stage.beta, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, stage.simpo_gamma)
    else:
        losses, chosen_rewards, rejected_rewards = preference_loss(
            stage.method, stage.beta, chosen_logps, rejected_logps, ref_chosen.to(device), ref_rejected.to(device),
            chosen_tokens, rejected_tokens)
    return losses, chosen_rewards, rejected_rewards, nll_logps, seen


def whole_sequence_logps(model, examples: list[Example], pad_id: int, device):
    """Each sequence's summed completion log-probs and completion tokens (as `side_logps`), the
    summed log-probs of every token after each sequence's first (prompt included), and the non-pad
    tokens processed: one forward for ORPO's chosen side."""
    ids, mask, labels = collate(examples, pad_id, device)
    logps, _, _ = label_logps(model, ids, mask, ids.masked_fill(mask == 0, IGNORE_INDEX))
    completion = labels[:, 1:] != IGNORE_INDEX
    return (logps * completion).sum(-1), completion.sum(-1), logps.sum(), int(mask.sum())


def nll_weight(stage: PreferenceStage) -> float:
    """The weight of the chosen side's NLL term in the loss: orpo 1, cpo `cpo_alpha`, else 0."""
    if stage.method == "orpo":
        return 1.0
    return stage.cpo_alpha if stage.method == "cpo" else 0.0


def nll_tokens(stage: PreferenceStage, chosen: list[Example]) -> int:
    """The tokens the NLL term averages over: orpo every token after each sequence's first, cpo the completions'."""
    if stage.method == "orpo":
        return sum(len(example.input_ids) - 1 for example in chosen)
    return sum(label != IGNORE_INDEX for example in chosen for label in example.labels[1:])


def sliced(values, piece: list[int]):
    """A reference tensor's rows of a micro-batch; None (a reference-free method) stays None."""
    return None if values is None else values[piece]


def held_out_pairs(model, chosen: list[Example], rejected: list[Example], ref_chosen, ref_rejected,
                   stage: PreferenceStage, pad_id: int, device, one_call: bool = False) -> dict[str, float]:
    """The preference loss (its NLL term averaged over all the held-out chosen tokens) and reward
    accuracy over held-out pairs (never trained on), in batches of the stage's size, without
    gradients; `one_call` as in `pair_logps`."""
    loss_sum, nll_sum, wins = 0.0, 0.0, 0.0
    with measuring(model):
        for start in range(0, len(chosen), stage.batch_size):
            piece = list(range(start, min(len(chosen), start + stage.batch_size)))
            losses, chosen_rewards, rejected_rewards, nll_logps, _ = piece_losses(
                model, [chosen[i] for i in piece], [rejected[i] for i in piece], sliced(ref_chosen, piece),
                sliced(ref_rejected, piece), stage, pad_id, device, one_call)
            loss_sum += losses.sum().item()
            nll_sum -= nll_logps.item()
            wins += (chosen_rewards > rejected_rewards).float().sum().item()
    nll = nll_weight(stage) * nll_sum / max(nll_tokens(stage, chosen), 1)
    return {"loss": loss_sum / len(chosen) + nll, "reward_accuracy": wins / len(chosen)}


def pairs_contract(ctx: StageContext) -> ContractParams:
    """The contract of the pairs a preference stage trained on (offline and online alike)."""
    return ContractParams(kind="preference", context_length=context_length(resolve_base(ctx.model.base)))
