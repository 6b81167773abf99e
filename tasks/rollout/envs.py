"""A stage's environments, ready to play: built from the spec's config, a dataset env given the rows
of its dataset stages and the scorers of its learned rewards (envs declare what they need; the stage
layer, which can read the store and load models, supplies it)."""

from __future__ import annotations

from envs.loader import make_env
from envs.tools.chat import use_policy_chat
from tasks.common.context import StageContext
from tasks.common.datasets import read_rows


def stage_env(ctx: StageContext, env_id: str, tokenizer=None):
    """The environment `env_id` of the spec: a dataset env gets the rows of its dataset stages and the
    scorers of its learned rewards (inputs of this stage; a reward model's tokenizer checked against
    `tokenizer`, the policy's)."""
    env = make_env(env_id, ctx.envs[env_id])
    use_policy_chat(env, tokenizer)
    if getattr(env, "reads_data", False):
        rows = [read_rows(ctx.fetch(stage_id)) for stage_id in env.data_stages()]
        env.use_rows(rows[0], rows[1] if len(rows) > 1 else None)
        if env.learned_rewards():
            from tasks.rollout.learned_rewards import attach_scorers  # loads torch: only where a reward is learned

            attach_scorers(env, env_id, ctx.fetch, ctx.model, ctx.device, tokenizer)
    return env
