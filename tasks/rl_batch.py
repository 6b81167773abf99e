"""The tensor side of an RL step: training rows from scored trajectories, their advantages,
padding, and the policy's per-token log-probs.

`grpo` trains one row per trajectory: the prompt, then every action and observation, with
the env-written tokens masked, and the trajectory's group advantage on every token.
`steppo` trains one row per turn: the state (context) as prompt and the action as the
completion, with the step's advantage (group-normalized reward-to-go).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.losses import token_logps
from models.rl_losses import group_advantages, step_advantages
from models.sampling import left_padded


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]  # 1 on the policy's tokens that carry gradient
    advantage: float


def training_rows(scored_groups: list[list], algorithm: str, group_size: int, scale: str, gamma: float,
                  mask_truncated: bool) -> list[Row]:
    """Rows of the kept groups (each a list of `group_size` scored trajectories of one prompt)."""
    import torch

    scored = [s for group in scored_groups for s in group]
    if algorithm == "grpo":
        advantages = group_advantages(torch.tensor([s.reward for s in scored]), group_size, scale).tolist()
        rows = []
        for s, advantage in zip(scored, advantages):
            ids, mask = s.trajectory.completion()
            if mask_truncated and any(turn.truncated for turn in s.trajectory.turns):
                mask = [0] * len(mask)
            rows.append(Row(s.trajectory.prompt_ids, ids, mask, advantage))
        return rows
    if algorithm == "steppo":
        per_step = step_advantages([s.step_rewards for s in scored], group_size, gamma, scale)
        rows = []
        for s, advantages in zip(scored, per_step):
            for turn, advantage in zip(s.trajectory.turns, advantages):
                keep = 0 if mask_truncated and turn.truncated else 1
                rows.append(Row(turn.context_ids, turn.action_ids, [keep] * len(turn.action_ids), advantage))
        return rows
    raise ValueError(f"unknown algorithm {algorithm!r}")


def padded_rows(rows: list[Row], pad_id: int, device):
    """Left-padded prompts, right-padded completions, the attention mask of the completions and the loss mask."""
    import torch

    prompt, prompt_mask = left_padded([r.prompt_ids for r in rows], pad_id, device)
    width = max(len(r.completion_ids) for r in rows)
    completion = torch.full((len(rows), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completion)
    loss_mask = torch.zeros_like(completion)
    for i, r in enumerate(rows):
        completion[i, :len(r.completion_ids)] = torch.tensor(r.completion_ids, dtype=torch.long)
        completion_mask[i, :len(r.completion_ids)] = 1
        loss_mask[i, :len(r.mask)] = torch.tensor(r.mask, dtype=torch.long)
    return prompt, prompt_mask, completion.to(device), completion_mask.to(device), loss_mask.to(device)


def completion_logps(model, prompt, prompt_mask, completion, completion_mask, temperature: float,
                     with_entropy: bool = False):
    """Per-token log-probs [B, T] of the completion under the temperature-scaled policy (and the
    per-token entropy of that distribution, without gradient, when asked)."""
    import torch

    ids = torch.cat([prompt, completion], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as the sampler numbers left-padded prompts
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, prompt.size(1) - 1:-1].float() / temperature
    logps = token_logps(logits, completion)
    if not with_entropy:
        return logps, None
    with torch.no_grad():
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy
