"""Policy-gradient losses of the GRPO family as pure functions over tensors (DOMAIN.md, "GRPO family").

Shapes: B completions, T completion positions; `mask` [B, T] is 1 on the tokens trained on
(completion tokens the policy wrote; env-written and padding tokens are 0).
"""

from __future__ import annotations

from dataclasses import dataclass

ADVANTAGE_EPS = 1e-4  # as TRL


def group_advantages(rewards, group_size: int, scale: str = "group"):
    """Â_i = (r_i − mean(r_group)) / (std + 1e-4), one value per completion.

    Completions are laid out group by group (`group_size` consecutive rows per prompt). std is
    the unbiased std of the group (`group`, GRPO) or of the whole batch (`batch`); `none` drops
    the division (Dr. GRPO). A NaN reward (a reward function raised) is left out of its group's
    mean and std and gets advantage 0, as in TRL.
    """
    import torch

    grouped = rewards.view(-1, group_size)
    centered = (grouped - grouped.nanmean(dim=1, keepdim=True)).view(-1)
    if scale == "none":
        advantages = centered
    elif scale == "group":
        advantages = centered / (_nanstd(grouped, dim=1).repeat_interleave(group_size) + ADVANTAGE_EPS)
    elif scale == "batch":
        advantages = centered / (_nanstd(rewards.view(1, -1), dim=1) + ADVANTAGE_EPS)
    else:
        raise ValueError(f"unknown reward scaling {scale!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def rloo_advantages(rewards, group_size: int, scale: str = "none"):
    """REINFORCE leave-one-out: Â_i = r_i − (Σ_{j≠i} r_j) / (n − 1), one value per completion.

    The baseline of each completion is the mean reward of the other completions of its group (laid
    out group by group, `group_size` per prompt; n counts the group's finite rewards). `batch` then
    centres and scales the advantages over the whole batch, (Â − mean) / (std + 1e-4) (TRL's
    `normalize_advantages`); `none` leaves them (TRL's default). A NaN reward, or a group with one
    finite reward, gets advantage 0 and is left out of the others' baselines, as in TRL.
    """
    import torch

    grouped = rewards.view(-1, group_size)
    finite = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (grouped.nansum(dim=1, keepdim=True) - grouped) / (finite - 1)
    advantages = rewards - baselines.view(-1)
    if scale == "batch":
        advantages = (advantages - advantages.nanmean()) / (_nanstd(advantages.view(1, -1), dim=1) + ADVANTAGE_EPS)
    elif scale != "none":
        raise ValueError(f"rloo scales its advantages over the batch or not at all, not by {scale!r}")
    return torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0)


def rewards_to_go(step_rewards: list[float], gamma: float = 1.0) -> list[float]:
    """R_k = Σ_{j ≥ k} γ^(j−k) · r_j for each step k of one trajectory."""
    returns, running = [], 0.0
    for reward in reversed(step_rewards):
        running = reward + gamma * running
        returns.append(running)
    return returns[::-1]


def step_advantages(step_rewards: list[list[float]], group_size: int, gamma: float = 1.0,
                    scale: str = "group") -> list[list[float]]:
    """StepPO's critic-free step advantages, one per step of each trajectory.

    A_k = (R_k − mean_G) / (std_G + 1e-4), R_k the reward-to-go of step k, mean_G and the
    unbiased std_G over the rewards-to-go of every step of every trajectory in the prompt group
    (trajectories laid out group by group, `group_size` per prompt); `batch` takes the std over
    the whole batch and `none` drops the division. A NaN reward-to-go gets advantage 0 and is
    left out of the statistics.
    """
    returns = [rewards_to_go(rewards, gamma) for rewards in step_rewards]
    keys = [i // group_size for i, trajectory in enumerate(returns) for _ in trajectory]
    return _centered_by_key(returns, keys, scale)


def _centered_by_key(returns: list[list[float]], keys: list, scale: str) -> list[list[float]]:
    """Each return minus the mean of the returns that share its key (`group`: divided by their
    unbiased std + 1e-4; `batch`: by that of every return); NaN → 0, left out of the statistics;
    laid back out per trajectory."""
    import torch

    flat = torch.tensor([r for trajectory in returns for r in trajectory], dtype=torch.float64)
    advantages = torch.zeros_like(flat)
    for key in set(keys):
        rows = torch.tensor([k == key for k in keys], dtype=torch.bool)
        values = flat[rows]
        centered = values - values.nanmean()
        if scale == "group":
            centered = centered / (_nanstd(values.view(1, -1), dim=1) + ADVANTAGE_EPS)
        advantages[rows] = centered
    if scale == "batch":
        advantages = advantages / (_nanstd(flat.view(1, -1), dim=1) + ADVANTAGE_EPS)
    elif scale not in ("group", "none"):
        raise ValueError(f"unknown reward scaling {scale!r}")
    advantages = torch.nan_to_num(advantages, nan=0.0).tolist()
    out, start = [], 0
    for trajectory in returns:
        out.append(advantages[start:start + len(trajectory)])
        start += len(trajectory)
    return out


COD_KINDS = ("solve", "hint")


def cod_returns(step_rewards: list[float], kinds: list[str]) -> list[float]:
    """Connect the Dots' per-step returns of one pack episode ("mean" style, DOMAIN.md, CoD).

    With r_0 … r_{S−1} the rewards of the solve turns in order and r^z_k that of the hint written
    after solve k:
        solve j:  R_j   = mean(r_j, r_{j+1}, …, r_{S−1})
        hint k:   R^z_k = mean(r^z_k, r_{k+1}, …, r_{S−1})
    so a hint (and an early attempt) is paid by how well the tasks after it went. S counts the
    solves the trajectory holds: a pack cut short averages over what it reached.
    """
    if any(kind not in COD_KINDS for kind in kinds):
        raise ValueError(f"cod returns need turns of kind {COD_KINDS}, got {sorted(set(kinds))}")
    solves = [reward for reward, kind in zip(step_rewards, kinds) if kind == "solve"]
    returns, seen = [], 0  # seen: solves up to and including this turn
    for reward, kind in zip(step_rewards, kinds):
        if kind == "solve":
            future = solves[seen:]
            seen += 1
        else:
            future = [reward, *solves[seen:]]
        returns.append(sum(future) / len(future))
    return returns


def cod_slots(kinds: list[str]) -> list[tuple[str, int]]:
    """(kind, index among the turns of that kind) of each turn: solve 0, hint 0, solve 1, …"""
    counts = {kind: 0 for kind in COD_KINDS}
    slots = []
    for kind in kinds:
        slots.append((kind, counts[kind]))
        counts[kind] += 1
    return slots


def cod_advantages(step_rewards: list[list[float]], kinds: list[list[str]], group_size: int,
                   scale: str = "none") -> list[list[float]]:
    """CoD's step advantages, one per turn of each pack episode.

    A = R − mean_G(R), R from `cod_returns` and mean_G over the trajectories of the same group
    (the G rollouts of one pack, laid out group by group, `group_size` per pack) at the same
    slot (episode type and index: solve j, or hint k). `none` keeps the difference; `group`
    divides by the unbiased std of the slot's returns + 1e-4, `batch` by that of every return in
    the batch. A NaN return gets advantage 0 and is left out of the statistics.
    """
    returns = [cod_returns(rewards, turn_kinds) for rewards, turn_kinds in zip(step_rewards, kinds)]
    keys = [(i // group_size, *slot) for i, turn_kinds in enumerate(kinds) for slot in cod_slots(turn_kinds)]
    return _centered_by_key(returns, keys, scale)


def _nanstd(values, dim: int):
    """Unbiased std over the non-NaN entries along `dim`."""
    count = (~values.isnan()).sum(dim=dim)
    squares = (values - values.nanmean(dim=dim, keepdim=True)).pow(2).nansum(dim=dim)
    return (squares / (count - 1).clamp(min=1)).sqrt()


def kl_k3(logps, ref_logps):
    """Per-token k3 estimate of KL(πθ ‖ πref): exp(ref − logp) − (ref − logp) − 1 (≥ 0)."""
    delta = ref_logps - logps
    return delta.exp() - delta - 1


def loss_denominator(aggregation: str, trained_tokens: list[int], max_completion_length: int | None = None) -> float:
    """What `grpo_loss` divides its sum by, for rows with `trained_tokens` masked tokens each:
    grpo B, dr_grpo B · max_completion_length, dapo the masked tokens (at least 1)."""
    if aggregation == "grpo":
        return float(len(trained_tokens))
    if aggregation == "dr_grpo":
        return float(len(trained_tokens) * max_completion_length)
    if aggregation == "dapo":
        return float(max(1, sum(trained_tokens)))
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def truncated_importance_weights(old_logps, behaviour_logps, mask, cap: float, level: str = "token"):
    """Truncated importance sampling (TIS) weights, without gradient, for rows sampled by another
    engine or an older policy than the trainer's:

        w_t = min(exp(old_logp_t − μ_t), C)

    old_logp_t the trainer's log-prob of token t before the update (the ratio's denominator), μ_t
    the behaviour policy's (what the sampler returned), C = `cap`. With level "sequence" every
    token of a row shares w = min(exp(mean_t (old_logp_t − μ_t)), C). 0 where `mask` is 0.
    """
    log_ratio = (old_logps - behaviour_logps).detach()
    mask = mask.to(log_ratio.dtype)
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1).expand_as(mask)
    elif level != "token":
        raise ValueError(f"unknown ratio level {level!r}")
    return log_ratio.exp().clamp(max=cap) * mask


def grpo_loss(logps, old_logps, advantages, mask, *, epsilon_low: float, epsilon_high: float, aggregation: str,
              max_completion_length: int | None = None, ref_logps=None, beta: float = 0.0,
              ratio_level: str = "token", kl_ratio_correction: bool = False, denominator: float | None = None,
              importance_weights=None):
    """Clipped policy-gradient loss with an optional k3 KL penalty; returns (loss, clipped token fraction).

    ρ_t = exp(logp_t − old_logp_t);  ℓ_t = −min(ρ_t·Â, clip(ρ_t, 1 − ε_low, 1 + ε_high)·Â) + β·KL_k3,t
    With ratio_level="sequence" (GSPO; StepPO's per-step ratio, one row per step) every token of
    a row shares s = exp(mean_t (logp_t − old_logp_t)), clipped once for the row.
    kl_ratio_correction multiplies the KL term by ρ (DeepSeek-V3.2's unbiased reverse-KL
    gradient; TRL ≥ 1.x does this by default).
    Aggregation over the masked tokens:
      grpo     mean over each sequence's tokens, then over sequences
      dr_grpo  sum / (B · max_completion_length)
      dapo     sum / number of masked tokens in the batch
    i.e. Σ_rows (Σ_t mask·ℓ / Σ_t mask) (grpo) or Σ mask·ℓ, divided by `loss_denominator`. When the
    rows are one micro-batch of a step, `denominator` is the whole step's (loss_denominator over all
    its rows), so the micro-batches' losses add up to the step's.
    With `importance_weights` w (`truncated_importance_weights`: rows an inference server or an
    older policy sampled) the policy-gradient term is w_t·min(…); the KL term is not weighted.
    """
    log_ratio = logps - old_logps
    if ratio_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r}")
    ratio = log_ratio.exp()
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages
    per_token = -unclipped.minimum(clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    if beta:
        kl = kl_k3(logps, ref_logps)
        per_token = per_token + beta * (kl * ratio if kl_ratio_correction else kl)
    mask = mask.to(per_token.dtype)
    if denominator is None:
        denominator = loss_denominator(aggregation, mask.sum(-1).tolist(), max_completion_length)
    if aggregation == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / denominator
    else:
        loss = (per_token * mask).sum() / denominator
    clip_fraction = (((clipped < unclipped).expand_as(mask) & (mask > 0)).sum() / mask.sum().clamp(min=1)).detach()
    return loss, clip_fraction


@dataclass(frozen=True)
class PolicyLoss:
    """`grpo_loss` with a stage's settings bound once (clip range, aggregation, KL weight β, ratio
    level), and the truncated importance weights of rows another engine sampled, capped at
    `importance_cap` at the same level (`truncated_importance_weights`). The formula: `grpo_loss`."""

    epsilon_low: float
    epsilon_high: float
    aggregation: str
    beta: float = 0.0
    ratio_level: str = "token"  # sequence: one ratio per row (StepPO's per step, GSPO)
    importance_cap: float = 2.0

    def __call__(self, logps, old_logps, advantages, mask, *, max_completion_length: int | None = None,
                 ref_logps=None, denominator: float | None = None, importance_weights=None):
        return grpo_loss(logps, old_logps, advantages, mask, epsilon_low=self.epsilon_low,
                         epsilon_high=self.epsilon_high, aggregation=self.aggregation,
                         max_completion_length=max_completion_length, ref_logps=ref_logps, beta=self.beta,
                         ratio_level=self.ratio_level, denominator=denominator,
                         importance_weights=importance_weights)

    def importance_weights(self, old_logps, behaviour_logps, mask):
        return truncated_importance_weights(old_logps, behaviour_logps, mask, self.importance_cap, self.ratio_level)

    def denominator(self, trained_tokens: list[int], max_completion_length: int) -> float:
        return loss_denominator(self.aggregation, trained_tokens, max_completion_length)
