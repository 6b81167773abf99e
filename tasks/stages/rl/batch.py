"""The tensor side of an RL step: training rows from scored trajectories, their advantages,
padding, and the policy's per-token log-probs.

`grpo` trains one row per trajectory: the prompt, then every action and observation, with
the env-written tokens masked, and the trajectory's group advantage on every token.
`steppo` trains one row per turn: the state (context) as prompt and the action as the
completion, with the step's advantage: group-normalized reward-to-go, or with credit `cod`
Connect the Dots' mean-style returns against the same slot of the pack's other rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.losses import IGNORE_INDEX
from models.rl_losses import COD_KINDS, cod_advantages, group_advantages, rloo_advantages, step_advantages
from models.sampling import left_padded
from models.token_logps import label_logps, runs_directly, shared_prefix_logps


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]  # 1 on the policy's tokens that carry gradient
    advantage: float
    behaviour_logps: list[float] | None = None  # the sampler's log-prob of each completion token
    policy_version: int = 0  # the (oldest) weights' version that sampled it


@dataclass(frozen=True)
class RowPlan:
    """How a step's scored groups become training rows, as the stage configures it (built once)."""

    algorithm: str
    group_size: int
    scale: str
    gamma: float
    mask_truncated: bool
    credit: str
    advantage: str

    @classmethod
    def of(cls, stage) -> "RowPlan":
        return cls(stage.algorithm, stage.group_size, stage.scale_rewards, stage.gamma, stage.mask_truncated,
                   stage.credit, stage.advantage)

    def rows(self, scored_groups: list[list]) -> list[Row]:
        return training_rows(scored_groups, self.algorithm, self.group_size, self.scale, self.gamma,
                             self.mask_truncated, self.credit, self.advantage)


def training_rows(scored_groups: list[list], algorithm: str, group_size: int, scale: str, gamma: float,
                  mask_truncated: bool, credit: str = "reward_to_go", advantage: str = "grpo") -> list[Row]:
    """Rows of the kept groups (each a list of `group_size` scored trajectories of one prompt);
    `advantage`: how grpo's per-trajectory rewards become advantages (group-normalized or RLOO)."""
    import torch

    scored = [s for group in scored_groups for s in group]
    if algorithm == "grpo":
        estimator = rloo_advantages if advantage == "rloo" else group_advantages
        advantages = estimator(torch.tensor([s.reward for s in scored]), group_size, scale).tolist()
        rows = []
        for s, advantage in zip(scored, advantages):
            ids, mask = s.trajectory.completion()
            if not ids:  # a server with no room left for the prompt: nothing was sampled
                continue
            if mask_truncated and any(turn.truncated for turn in s.trajectory.turns):
                mask = [0] * len(mask)
            rows.append(Row(s.trajectory.prompt_ids, ids, mask, advantage, s.trajectory.behaviour_logps(),
                            s.trajectory.policy_version))
        return rows
    if algorithm == "steppo":
        if credit == "cod":
            per_step = cod_credit(scored_groups, group_size, gamma, scale)
        elif credit == "reward_to_go":
            per_step = step_advantages([s.step_rewards for s in scored], group_size, gamma, scale)
        else:
            raise ValueError(f"unknown credit {credit!r}")
        rows = []
        for s, advantages in zip(scored, per_step):
            for turn, advantage in zip(s.trajectory.turns, advantages):
                if not turn.action_ids:  # cut before a token was sampled (the server's context was full)
                    continue
                keep = 0 if mask_truncated and turn.truncated else 1
                behaviour = turn.action_logprobs if len(turn.action_logprobs) == len(turn.action_ids) else None
                rows.append(Row(turn.context_ids, turn.action_ids, [keep] * len(turn.action_ids), advantage,
                                behaviour, turn.policy_version))
        return rows
    raise ValueError(f"unknown algorithm {algorithm!r}")


def cod_credit(scored_groups: list[list], group_size: int, gamma: float, scale: str) -> list[list[float]]:
    """Step advantages under credit `cod`: the groups of CoD packs (turns of kind solve/hint) get
    `cod_advantages`; the other envs' groups of a mix keep reward-to-go (`step_advantages`)."""
    is_cod = [any(turn.kind in COD_KINDS for s in group for turn in s.trajectory.turns) for group in scored_groups]
    packs = [s for group, cod in zip(scored_groups, is_cod) if cod for s in group]
    others = [s for group, cod in zip(scored_groups, is_cod) if not cod for s in group]
    pack_rows = iter(cod_advantages([s.step_rewards for s in packs], [cod_kinds(s.trajectory.turns) for s in packs],
                                    group_size, scale) if packs else [])
    other_rows = iter(step_advantages([s.step_rewards for s in others], group_size, gamma, scale) if others else [])
    return [next(pack_rows if cod else other_rows) for group, cod in zip(scored_groups, is_cod) for _ in group]


def cod_kinds(turns) -> list[str]:
    """The kinds of a pack episode's turns; a cut action (kind "action": the env never saw it) is
    the turn that alternation gives: a hint after a solve, else a solve."""
    kinds = []
    for turn in turns:
        kinds.append(turn.kind if turn.kind in COD_KINDS else "hint" if kinds[-1:] == ["solve"] else "solve")
    return kinds


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


def padded_behaviour(rows: list[Row], device):
    """The rows' behaviour log-probs, right-padded as `padded_rows`' completions; None when a row has none."""
    import torch

    if any(r.behaviour_logps is None for r in rows):
        return None
    width = max(len(r.completion_ids) for r in rows)
    behaviour = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        behaviour[i, :len(r.behaviour_logps)] = torch.tensor(r.behaviour_logps, dtype=torch.float32)
    return behaviour.to(device)


def completion_logps(model, prompt, prompt_mask, completion, completion_mask, temperature: float,
                     with_entropy: bool = False):
    """Per-token log-probs [B, T] of the completion under the temperature-scaled policy (0 on
    padding), and the per-token entropy of that distribution, without gradient, when asked. Logits
    only at the completion's positions, in chunks (models/token_logps.py). Where the model runs
    directly, each distinct prompt (a group's) goes through it once (`shared_prompt_logps`)."""
    import torch

    shared = shared_prompt_logps(model, prompt, prompt_mask, completion, completion_mask, temperature, with_entropy)
    if shared is not None:
        return shared

    ids = torch.cat([prompt, completion], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as the sampler numbers left-padded prompts
    labels = torch.cat([torch.full_like(prompt, IGNORE_INDEX), completion.masked_fill(completion_mask == 0,
                                                                                      IGNORE_INDEX)], dim=1)
    logps, entropy, _ = label_logps(model, ids, mask, labels, positions, temperature, with_entropy)
    start = prompt.size(1) - 1  # the position that predicts the completion's first token
    return logps[:, start:], entropy[:, start:] if entropy is not None else None


def shared_prompt_logps(model, prompt, prompt_mask, completion, completion_mask, temperature: float,
                        with_entropy: bool):
    """As `completion_logps`, each distinct prompt computed once for the completions that continue
    it, and no padding through the projections and MLP (models/direct_forward.py:
    `shared_prefix_hidden`); None where the model does not run directly."""
    from models.decoding import unique_rows

    if not runs_directly(model):
        return None
    first, owner = unique_rows(prompt, prompt_mask)
    prefixes, prefix_mask = right_aligned(prompt[first], prompt_mask[first])
    labels = completion.masked_fill(completion_mask == 0, IGNORE_INDEX)
    result = shared_prefix_logps(model, prefixes, prefix_mask, completion, completion_mask, owner, labels,
                                 temperature, with_entropy)
    return result[:2] if result is not None else None


def right_aligned(ids, mask):
    """Left-padded rows turned right-padded (each row's tokens moved to start at column 0)."""
    import torch

    shift = (mask == 0).sum(-1)
    index = (torch.arange(ids.size(1), device=ids.device) + shift[:, None]) % ids.size(1)
    return ids.gather(1, index), mask.gather(1, index)
