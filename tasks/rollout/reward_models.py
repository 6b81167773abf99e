"""What a reward model computes, for the stage that trains one (tasks/stages/reward_model.py) and
the scorer that rewards with one (tasks/rollout/learned_rewards.py): a (prompt, answer) through the
chat template as one sequence, its score the scalar head's value at its last token
(transformers' sequence classification with one label, as TRL's RewardTrainer reads it)."""

from __future__ import annotations

import zlib

from tasks.common.encoding import Example, answer_example, collate
from tasks.common.errors import ConfigMismatch

SCORE_BATCH = 32


def reward_examples(tokenizer, items: list[tuple[object, object]], max_len: int) -> list[Example]:
    """Each (prompt, answer) as the sequence a reward model scores."""
    return [answer_example(tokenizer, prompt, answer, max_len) for prompt, answer in items]


def reward_scores(model, examples: list[Example], pad_id: int, device):
    """The score of each example [N] (one forward; gradients flow when enabled)."""
    ids, mask, _ = collate(examples, pad_id, device)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def scores_in_batches(model, examples: list[Example], pad_id: int, device, batch: int = SCORE_BATCH) -> list[float]:
    """`reward_scores` of many examples without gradients, `batch` at a time."""
    import torch

    was_training = model.training
    model.eval()
    values = []
    with torch.no_grad():
        for start in range(0, len(examples), batch):
            values += reward_scores(model, examples[start:start + batch], pad_id, device).tolist()
    model.train(was_training)
    return values


def held_out(pair_id: str, eval_fraction: float) -> bool:
    """Whether a pair is in the held-out split (by a hash of its id: stable across runs and machines)."""
    return zlib.crc32(pair_id.encode()) % 10_000 < eval_fraction * 10_000


def check_same_tokenizer(reward_tokenizer, policy_tokenizer, where: str) -> None:
    """A reward model scores text the policy wrote, rendered by its own chat template: refused
    (one line) when its tokenizer is not the policy's, whose conventions it was trained on."""
    ours, theirs = reward_tokenizer.get_vocab(), policy_tokenizer.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:1]
        raise RewardModelMismatch(f"{where}: the reward model's tokenizer is not the policy's ({len(ours)} vs "
                                  f"{len(theirs)} tokens; first difference: {differ[0][0]!r}); train the reward "
                                  "model from the policy's base model")


class RewardModelMismatch(ConfigMismatch):
    """A reward model that cannot score this policy's completions (one line; retrying cannot fix it)."""
